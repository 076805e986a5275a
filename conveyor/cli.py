"""``conveyor train|presets|actor|eval|enjoy|export|bench|plot|tune``.

``train`` flags are generated from the config dataclasses, one per field,
with the field's docstring as help; so the docs' configuration table,
``--help`` and the config never disagree. Expected mistakes (bad values,
unknown ids, unwritable dirs, corrupt checkpoints) print one line and exit
with code 2; a run that fails (a dead worker, non-finite updates, a full
disk) prints one line and exits with code 1; there is no traceback for them.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import signal
import sys
import threading
import types
import typing
from pathlib import Path
from typing import Any, Callable

from conveyor import presets
from conveyor.config import (AlgoCfg, ArchCfg, EnvCfg, ModelCfg, RunCfg, check_resume_change, field_docs,
                             flag_name, flat_fields, merged_env_args, parse_env_arg, read_config_file)
from conveyor.errors import CheckpointError, ConfigError, RunFailure, StoppedWhileStarting, WorkerFailure
from conveyor.procs import adopt_orphans, end_descendants
from conveyor.flag_file import flag_tokens, read_flag_file

USAGE_ERROR = 2
RUN_FAILED = 1
INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C
HUNG_UP = 128 + signal.SIGHUP
"""The exit code of a run that SIGHUP (a closed terminal, a dropped SSH connection) stopped, once it has saved: as a
shell reports a process the signal ended, so that whatever waits for the run knows nobody asked it to stop. Ctrl-C
and SIGTERM are requests to stop (exit code 0: ``conveyor bench`` and ``tune`` stop their runs with SIGTERM)."""

# Second spellings of a flag: --backend is issue 47's name for --env-backend.
FLAG_ALIASES = {("env", "backend"): ("--backend",)}
SECTIONS: dict[str, type] = {"env": EnvCfg, "model": ModelCfg, "algo": AlgoCfg, "arch": ArchCfg}

# Subcommands that live in their own modules: name -> (module, help). Each module has
# add_arguments(parser) and main(args) -> int.
EXTERNAL_COMMANDS: dict[str, tuple[str, str]] = {
    "eval": ("conveyor.evaluate", "evaluate a run's checkpoints: final, final time and required time metrics"),
    "enjoy": ("conveyor.enjoy", "watch a run's policy play: episode returns, a window (--render human) or a video"),
    "export": ("conveyor.export", "export a run's policy network with its preprocessing to TorchScript or ONNX"),
    "bench": ("conveyor.bench", "run a benchmark suite (architectures x algorithms x envs x seeds, peers)"),
    "plot": ("conveyor.plots", "plot returns, SPS and policy-lag histograms of run directories"),
    "report": ("conveyor.bench.aggregate", "aggregate runs over seeds and envs: IQM with bootstrap CIs, profiles, "
               "probability of improvement, curves; --export: their small committable form"),
    "actor": ("conveyor.architectures.seed.actor", "run a SEED actor: step envs for a `train --arch seed` learner over gRPC"),
    "tune": ("conveyor.tune", "search hyperparameters with Optuna: parallel trials, pruning, best.toml for --config"),
}


class UsageError(Exception):
    """A mistake in the command line; printed as one line, exit code 2."""


def _dest(section: str | None, name: str) -> str:
    return f"{section}.{name}" if section else name


def _parse_optional_float(text: str) -> float | None:
    if text.lower() == "none":
        return None
    return float(text)


def _parse_int_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part)


def _is_preset(section: str | None, fld: dataclasses.Field) -> bool:
    """Whether the field's default None means "from the preset" (``target_return``'s None is a value of its own:
    the env's reward threshold, ``--target-return none``)."""
    return fld.default is None and (section, fld.name) != (None, "target_return")


def _default_text(section: str | None, fld: dataclasses.Field) -> str:
    """A field's default as the help and the docs show it: ``preset`` for fields the presets fill."""
    if _is_preset(section, fld):
        return "preset"
    return repr(fld.default if fld.default is not dataclasses.MISSING else None)


def _add_field(group: argparse._ArgumentGroup, section: str | None, fld: dataclasses.Field, doc: str,
               hints: dict[str, Any]) -> None:
    flag, dest = flag_name(section, fld.name), _dest(section, fld.name)
    flags = (flag, *FLAG_ALIASES.get((section, fld.name), ()))
    help_text = f"{doc.split(chr(10))[0]} (default: {_default_text(section, fld)})".replace("%", "%%")
    hint = hints[fld.name]
    if _is_preset(section, fld):  # X | None: a flag gives an X; None, its absence, leaves it to the preset
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    if hint is bool:
        group.add_argument(*flags, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=help_text)
    elif fld.name == "env_args":
        group.add_argument(*flags, dest=dest, action="append", type=parse_env_arg, metavar="KEY=VALUE", help=help_text)
    elif typing.get_origin(hint) is tuple:
        group.add_argument(*flags, dest=dest, type=_parse_int_tuple, metavar="N,N", help=help_text)
    elif typing.get_origin(hint) in (typing.Union, types.UnionType):  # target_return: a float, or none
        group.add_argument(*flags, dest=dest, type=_parse_optional_float, metavar="X", help=help_text)
    else:
        group.add_argument(*flags, dest=dest, type=hint, metavar=fld.name.upper(), help=help_text)


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="a TOML file of these flags keyed by their names without "
                        "the dashes (lr = 0.001, num-envs = 16; `conveyor tune` writes best.toml): flags given here "
                        "win over it, and it wins over the presets")
    for section, cls in [(None, RunCfg), *SECTIONS.items()]:
        group = parser.add_argument_group(section or "run")
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        for fld in dataclasses.fields(cls):
            if section is None and fld.name in SECTIONS:
                continue
            _add_field(group, section, fld, docs.get(fld.name, ""), hints)


def config_reference() -> str:
    """docs/configuration.md's table: one row per flag (tests keep that page equal to it)."""
    rows = ["| flag | field | default | meaning |", "|---|---|---|---|"]
    for section, cls in [(None, RunCfg), *SECTIONS.items()]:
        docs = field_docs(cls)
        for fld in dataclasses.fields(cls):
            if section is None and fld.name in SECTIONS:
                continue
            doc = " ".join(docs.get(fld.name, "").split())
            rows.append(f"| `{flag_name(section, fld.name)}` | `{_dest(section, fld.name)}` "
                        f"| `{_default_text(section, fld)}` | {doc} |")
    return "\n".join(rows)


def _command_line_flags(args: argparse.Namespace) -> dict[str, Any]:
    """``section.field`` (or a RunCfg field name) -> value, for every train flag on the command line."""
    return {k: v for k, v in vars(args).items() if v is not None and k not in ("command", "handler", "config")}


def _given_flags(args: argparse.Namespace) -> dict[str, Any]:
    """``_command_line_flags`` over the values of ``--config FILE``."""
    return {**_file_flags(args), **_command_line_flags(args)}


def train_flag_types() -> dict[str, Any]:
    """The train flags' names without their dashes (the keys of a ``--config`` file) -> their fields' types
    (``int`` for ``int | None``)."""
    types_by_name = {}
    for section, cls in [(None, RunCfg), *SECTIONS.items()]:
        hints = typing.get_type_hints(cls)
        for fld in dataclasses.fields(cls):
            if not (section is None and fld.name in SECTIONS):
                hint = hints[fld.name]
                if typing.get_origin(hint) in (typing.Union, types.UnionType):
                    hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
                for flag in (flag_name(section, fld.name), *FLAG_ALIASES.get((section, fld.name), ())):
                    types_by_name[flag.removeprefix("--")] = hint
    return types_by_name


def _train_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="conveyor train")
    add_train_arguments(parser)
    return parser


def config_from_flags(flags: dict[str, Any]) -> RunCfg:
    """The RunCfg of train flags given as a ``--config`` file gives them (name without dashes -> value)."""
    return config_from_args(_train_parser().parse_args(flag_tokens(flags)))


def _file_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The values of ``--config FILE`` (``flag_file.py``) under the names the flags' values go by, read by the
    train parser as if given on the command line."""
    path = getattr(args, "config", None)
    if not path:
        return {}
    try:
        parsed = _train_parser().parse_args(flag_tokens(read_flag_file(path, set(train_flag_types()))))
    except UsageError as error:
        raise UsageError(f"--config {path}: {error}") from None
    return _command_line_flags(parsed)


def config_from_args(args: argparse.Namespace) -> RunCfg:
    """A RunCfg from the flags that were given; with ``--resume`` the earlier run's config is the base."""
    given = _given_flags(args)
    base: dict[str, Any] = {}
    recorded: dict[str, Any] = {}
    if given.get("resume"):
        base = _resumed_config(given["resume"], given.get("out"))
        recorded = flat_fields(RunCfg.from_dict(base))  # config.json checked before any flag is taken
    sections: dict[str, dict[str, Any]] = {name: dict(base.get(name, {})) for name in SECTIONS}
    top = {k: v for k, v in base.items() if k not in SECTIONS}
    for dest, value in given.items():
        section, _, name = dest.rpartition(".")
        if name == "env_args":  # on resume: in place of the recorded ones with the same keys, the others kept
            value = merged_env_args(recorded.get(dest, ()), tuple(value))
        if recorded and dest not in ("resume", "out"):
            check_resume_change(dest, recorded[dest], value, given["resume"])  # the rule Run applies again
        (sections[section] if section else top)[name] = value
    if not recorded:  # a resumed run's config.json holds every preset value (and the family, unless it predates it)
        _find_env_family(sections["env"])
    data = {**top, **sections}
    return RunCfg.from_dict(data)


def _find_env_family(env: dict[str, Any]) -> None:
    """Set ``env["family"]`` (the ``env`` section of a config being built) where it is not given and the id alone
    does not tell it (``RunCfg`` fills it then): an env of your own is built once here to find it."""
    env_id, env_args = env.get("id", EnvCfg.id), tuple(env.get("env_args", ()))
    if env.get("family") is None and presets.id_family(env_id, env_args) is None:
        from conveyor.envs.gym_api import env_family  # here: it imports the env stack, which few configs need

        env["family"] = env_family(env_id, env_args)


def _resumed_config(run_dir: str, out: str | None) -> dict[str, Any]:
    """The config of the run in ``run_dir`` (its ``config.json``) to continue there: whatever ``out`` that file
    names (it may be a copy of another run), a resumed run writes only into ``run_dir``."""
    if out and Path(out).resolve() != Path(run_dir).resolve():
        raise UsageError(f"--resume {run_dir} continues that run in place: drop --out {out} (to continue "
                         "elsewhere, copy the directory there and --resume the copy)")
    config_file = Path(run_dir) / "config.json"
    if not config_file.is_file():
        raise UsageError(f"--resume {run_dir}: no config.json there; pass the --out DIR of an earlier run")
    return {**read_config_file(config_file), "resume": run_dir, "out": run_dir}


def cmd_train(args: argparse.Namespace) -> int:
    from conveyor import train

    cfg = config_from_args(args)
    summary = train(cfg)
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 speaks for the run (and writes its files)
        print(_summary_line(summary))
    return _stop_code(summary["stop_reason"])  # the same on every rank (share_progress)


def _stop_code(stop_reason: str) -> int:
    return HUNG_UP if stop_reason == f"signal {signal.SIGHUP.name}" else 0


def cmd_presets(args: argparse.Namespace) -> int:
    """Without train flags: the preset tables. With them (or ``--config FILE``): the run's resolved config, one
    line per field, each value marked explicit, config(FILE) over what it replaces, preset(LAYER) or default."""
    given = _command_line_flags(args)
    if not given and not args.config:
        print("\n".join(table_lines()))
        return 0
    print("\n".join(explain_lines(config_from_args(args), set(given), _file_origins(args, set(given)))))
    return 0


def _file_origins(args: argparse.Namespace, given: set[str]) -> dict[str, str]:
    """For each value ``--config FILE`` sets (and no flag overrides): the file, and what it overrides there."""
    from_file = set(_file_flags(args)) - given
    if not from_file:
        return {}
    try:
        without = config_from_args(argparse.Namespace(**{**vars(args), "config": None}))
    except (ConfigError, UsageError):  # the file's values are what make the flags valid: no base to compare
        return {key: f"config({args.config})" for key in from_file}
    values, sources = flat_fields(without), without.preset_sources
    return {key: f"config({args.config}) over {f'preset({sources[key]})' if key in sources else 'default'} "
                 f"{values[key]!r}" for key in from_file}


def table_lines() -> list[str]:
    """The preset tables, layer by layer (``conveyor presets``)."""
    lines = ["# arch -> algorithm when --algo is not given"]
    lines += [f"  {arch}: {presets.own_algo(arch)}" for arch in presets.ARCH_ALGOS]
    lines += ["# --preset (IMPACT comparison presets; explicit values that contradict them are refused)"]
    lines += [f"  {name}: algo.name={algo} " + " ".join(f"arch.{k}={v!r}" for k, v in fixed.items())
              for name, (fixed, algo) in presets.IMPACT_PRESETS.items()]
    lines.append("# base: every preset field (the layers below override it, later ones earlier ones)")
    lines += [f"  {name} = {value!r}" for name, value in presets.BASE.items()]
    groups: list[tuple[str, dict[Any, dict[str, Any]]]] = [
        ("algo", presets.ALGO), ("family", presets.FAMILY), ("algo/family", presets.ALGO_FAMILY),
        ("arch/algo/family", presets.ARCH_ALGO_FAMILY), ("--preset/family", presets.PRESET_FAMILY)]
    for title, group in groups:
        lines.append(f"# {title}")
        for key, values in group.items():
            lines.append(f"  {'/'.join(key) if isinstance(key, tuple) else key}:")
            lines += [f"    {name} = {value!r}" for name, value in values.items()]
    return lines


def explain_lines(cfg: RunCfg, given: set[str], file_origins: dict[str, str] | None = None) -> list[str]:
    """One line per field of ``cfg``: value and origin, ``explicit`` (in ``given``, ``section.field`` names),
    ``config(FILE) over ...`` (``file_origins``: the values of ``--config FILE``, beside what they override),
    ``preset(LAYER)``, ``env`` (the family the env has) or ``default`` (the dataclass default)."""
    sources = cfg.preset_sources
    lines = [f"# {cfg.arch.name}/{cfg.algo.name} on {cfg.env.id} (family {cfg.env.family})"]
    for key, value in flat_fields(cfg).items():
        origin = f"preset({sources[key]})" if key in sources else "explicit" if key in given else "default"
        if key == "env.family" and origin == "default" and value is not None:
            origin = "env"  # told by the id (RunCfg) or by building the env (_find_env_family)
        origin = (file_origins or {}).get(key, origin)
        lines.append(f"{key} = {value!r}  {origin}")
    return lines


def _summary_line(summary: dict[str, Any]) -> str:
    ret = summary["return_mean_last100"]
    ret_text = "n/a" if ret is None or (isinstance(ret, float) and math.isnan(ret)) else f"{ret:.1f}"
    split = summary.get("time_split_fraction", {})
    split_text = " ".join(f"{k} {v:.0%}" for k, v in split.items())
    return (f"{summary['arch']}/{summary['algo']} on {summary['env']}: {summary['env_steps']:,} steps in "
            f"{summary['wall_time_s']:.1f}s ({summary['sps']:.0f} SPS), {summary['episodes']} episodes, "
            f"return (last 100) {ret_text}, lag mean {summary['policy_lag']['mean']:.2f}; time split: {split_text}; "
            f"stopped: {summary['stop_reason']}; results in {summary['out']}")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        raise UsageError(message)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser. With ``command``, only that subcommand's module is imported to add its arguments (the
    others are listed by name and help alone): ``conveyor actor`` must not import torch, which the other
    subcommands' modules do."""
    parser = _Parser(prog="conveyor", description="High-throughput deep RL: paac, ga3c, seed, impact, hts.")
    commands = parser.add_subparsers(dest="command", parser_class=_Parser)
    train = commands.add_parser("train", help="train an agent (no flags: PAAC A2C solves CartPole-v1)")
    add_train_arguments(train)
    train.set_defaults(handler=cmd_train)
    shown = commands.add_parser("presets", help="print the preset tables, or (with train flags) a run's resolved "
                                "config and where each value comes from")
    add_train_arguments(shown)
    shown.set_defaults(handler=cmd_presets)
    for name, (module_name, help_text) in EXTERNAL_COMMANDS.items():
        sub = commands.add_parser(name, help=help_text)
        if command is None or command == name:
            module = importlib.import_module(module_name)
            module.add_arguments(sub)
            sub.set_defaults(handler=module.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``conveyor`` command; its exit code. Without ``argv`` (the command line: this process is the
    ``conveyor`` command, not a caller of it) the process ends everything an env leaves behind
    (``_exit_cleanly``)."""
    if argv is None:
        adopt_orphans()
    try:
        code = _main(argv)
    except KeyboardInterrupt:  # Ctrl-C outside a run's own signal handling (while torch imports, say): no traceback
        print("conveyor: interrupted", file=sys.stderr)
        code = INTERRUPTED
    if argv is None:
        _exit_cleanly(code)
    return code


def _exit_cleanly(code: int) -> None:
    """End the processes an env left behind (forks, adopted as orphans: ``procs.adopt_orphans``); if threads an
    env started (not daemons) still run, exit now with ``code`` rather than wait for them forever. The run has
    closed everything of its own by now: the summary is written and printed, the checkpoints saved. A thread
    cannot be ended from outside in Python, and with the in-process env backend (or an env that the presets
    build to read its action space) the env lives in this process by design, so leaving at once is the one way
    to keep the promise that the command ends."""
    ended = end_descendants()
    if ended:
        print(f"conveyor: ended {len(ended)} process(es) left behind (pids {', '.join(map(str, ended))}), "
              "started by an env", file=sys.stderr)
    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if threads:
        print(f"conveyor: exiting without waiting for thread(s) {', '.join(threads)}, left running by an env",
              file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _main(argv: list[str] | None) -> int:
    expected: tuple[type[BaseException], ...] = (UsageError, ConfigError, CheckpointError)
    argv = sys.argv[1:] if argv is None else argv
    try:
        # The first word that is not an option names the subcommand (the top-level parser has only -h).
        parser = build_parser(next((word for word in argv if not word.startswith("-")), None))
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return USAGE_ERROR
        handler: Callable[[argparse.Namespace], int] = args.handler
        return handler(args)
    except expected as error:
        sys.stderr.write(f"conveyor: error: {error}\n")  # one write: torchrun ranks print theirs at once
        return USAGE_ERROR
    except StoppedWhileStarting as error:
        print(f"conveyor: stopped: {error}", file=sys.stderr)
        return _stop_code(error.stop_reason)
    except WorkerFailure as error:
        first_line = str(error).strip().splitlines()[0]
        print(f"conveyor: run failed: {first_line}; continue from the run's last checkpoint with --resume DIR",
              file=sys.stderr)
        return RUN_FAILED
    except RunFailure as error:
        print(f"conveyor: run failed: {error}", file=sys.stderr)
        return RUN_FAILED


if __name__ == "__main__":
    sys.exit(main())
