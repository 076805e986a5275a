PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv train test test-slow test-learning bench bench-deps peers clean docs

# Python caches compiled modules (__pycache__, ignored by git) even where the environment says not to (these
# machines set PYTHONDONTWRITEBYTECODE=1): every test that starts a process (a CLI run, actors, env workers) would
# compile conveyor from source again, and pytest would rewrite every test module's asserts on each worker.
# make test: 170 s with it set, 150 s without (2-core VM, 2026-11-28).
unexport PYTHONDONTWRITEBYTECODE

# Build .venv from scratch with exact pins; re-runs only when the pins or the package metadata change.
venv: $(STAMP)
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test,envpool,ray,docs,tune]'
	touch $(STAMP)

# The default job: PAAC A2C solves CartPole-v1 (mean return of the last 100 episodes >= 475).
train: venv
	$(BIN)/conveyor train

# Two pytest workers (pytest-xdist): CI has 2 cores, and most tests wait on processes they start (envs, actors,
# torchrun), so two tests at once keep the cores busy. worksteal hands out single tests and lets an idle worker
# take the other's pending ones: whole files per worker (loadfile) left one worker idle for the last 7+ minutes
# of a clean-clone run. A module fixture is built at most once per worker. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2

# Both print their 15 slowest tests. Exit code 5 is pytest's "no test selected", not a failure.
test: venv
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=15 || [ $$? -eq 5 ]

# The tests marked slow (learning runs, Ray, torchrun, long fault runs), on the same two workers: each test has
# its own tmp_path and ports (torchrun --standalone, a local Ray of its own, SEED's localhost:0).
# --timeout 900: a learning run takes up to 6 minutes here, more beside another slow test; a test's own mark wins.
test-slow: venv
	$(BIN)/python -m pytest -q -m slow -n $(TEST_WORKERS) --dist worksteal --durations=15 --timeout 900 || [ $$? -eq 5 ]

# The learning tests are the slow ones (each architecture learns with its presets); the whole matrix is
# `conveyor bench --suite learning`.
test-learning: test-slow

# Peers (stable-baselines3) are an optional group, kept out of the core install. rl_zoo3 (the race's SB3 settings,
# read from its hyperparams/*.yml) goes in without its dependencies: they cannot resolve against the pins
# (pytablewriter's typepy[datetime] wants python-dateutil<3), and the race imports none of them.
bench-deps: venv
	$(BIN)/pip install --quiet -c constraints.txt -e '.[bench]'
	$(BIN)/pip install --quiet --no-deps -c constraints.txt rl_zoo3

# The race's outside peers, each in a venv of its own with this torch: .peers/sample-factory (gymnasium 0.29,
# numpy 1.26) and .peers/cleanrl (cleanrl 1.2.0's scripts, gym 0.23.1, gymnasium 0.28.1, SB3 1.2.0, ale-py 0.8.1).
peers: bench-deps
	$(BIN)/python -m conveyor.bench.external build

bench: bench-deps
	$(BIN)/conveyor bench --suite quick --out bench-results/quick

# The docs site (mkdocs.yml, docs/) into site/; --strict: a broken link or anchor, or a docstring mkdocstrings
# cannot read, fails the build. NO_MKDOCS_2_WARNING silences Material's banner about its end of life (2027-05-05).
docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) runs bench-results site .peers
