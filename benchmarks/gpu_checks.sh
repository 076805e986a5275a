#!/usr/bin/env bash
# The checks that need a GPU machine (one cuda device, 16 cores), in one pass that fits a short lease:
#   cuda-tests   tests/test_cuda.py: every architecture trains on cuda and resumes on either device; an acting
#                step's only host sync is reading the actions;
#   atari-tests  the tests of make test that train on Atari, which the Atari presets put on cuda here;
#   paac-vs-sb3  PAAC vs stable-baselines3 A2C on Pong at 16 envs, both learners on cuda (issue 19: >= 3x);
#   env-limit-32, env-limit-64   every architecture's Pong SPS against the env limit, learners on cuda;
#   paac-128     PAAC at 128 envs (with the two above: the best n_e / n_w);
#   overlap-16, overlap-64       PAAC env groups off and on, on cuda (is --env-groups 2 faster there?);
#   profile      a torch.profiler profile of PAAC's Pong step on cuda;
#   pong-seed-vtrace, pong-impact-impact, pong-paac-a2c   issue 15's Pong row for that arch/algo with nothing
#                but --arch --algo --env --seed (the Atari presets pick cuda and a worker per core: the log
#                prints what config.json recorded) for $PONG_SECONDS (default 300), or until the mean of its
#                last 100 returns reaches $PONG_TARGET (when set), all Pong runs together in at most $PONG_BUDGET_S
#                (when set: a run that reaches the target early leaves its time to the next); metrics land in
#                benchmarks/results/pong-gpu-ARCH-ALGO/. Run archives and checkpoints are not kept in the
#                repository (issue 49: a lean tree), so each lease starts each run from scratch with those same
#                flags (its results folder's config.json is what they resolved to) and records where it stopped
#                (env steps, mean of the last 100 returns, why) in the log and in $1/pong_runs.tsv. Where the
#                results folder already holds a longer run, this run's files go beside it, to
#                benchmarks/results/pong-gpu-ARCH-ALGO-lease-YYYYMMDD/, instead of replacing it.
# Each step has its own time limit and a failure does not stop the next. Results land where the CPU runs'
# do (benchmarks/results/, the marked sections of docs/benchmarks-log.md); the log and a tarball of both go to $1,
# the tarball after every step. GPU_CHECKS="cuda-tests profile" runs only the steps named (default: all).
#
#   benchmarks/gpu_checks.sh OUTDIR
#
# The machine needs torch with cuda plus this project's dependencies; where it cannot download, carry wheels
# and put them on PYTHONPATH before calling: benchmarks/gpu_wheels.sh downloads those this workplace's GPU image
# lacks (26 MB) and says how to install them there. About 7 minutes on an H200, plus the Pong runs.
set -uo pipefail
out=${1:?usage: benchmarks/gpu_checks.sh OUTDIR}
mkdir -p "$out"
log="$out/gpu_checks.log"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
only=" ${GPU_CHECKS:-} "

step() {  # step SECONDS NAME COMMAND...: run it under a time limit, log its output and its exit status
    local limit=$1 name=$2; shift 2
    [[ "$only" == "  " || "$only" == *" $name "* ]] || return 0
    echo "=== $name ($(date -u +%T), limit ${limit}s): $*" | tee -a "$log"
    local start=$SECONDS
    timeout -k 10 "$limit" "$@" 2>&1 | grep -v -e '^A.L.E: Arcade' -e 'Powered by Stella' | tee -a "$log"
    echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - start)) s" | tee -a "$log"
    tar czf "$out/results.tgz" --exclude=runs docs/benchmarks-log.md benchmarks/results
}

bench=(--device cuda --seconds 8 --startup-s 10 --repeats 1 --out /tmp/env-limit)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$log"
step 200 cuda-tests "$py" -m pytest tests/test_cuda.py -q -n 6 -p no:cacheprovider
# make test's runs on Atari take the Atari presets, so on this machine they learn on cuda
step 150 atari-tests "$py" -m pytest -q -n 8 -p no:cacheprovider tests/test_presets.py \
    tests/test_ga3c.py::test_ga3c_pong_smoke_with_nature_cnn tests/test_r2d2.py::test_seed_r2d2_runs_on_pong
step 110 paac-vs-sb3 "$py" benchmarks/paac_vs_sb3_pong.py --device cuda --workers 8 --steps 24000 --repeats 3 \
    --out benchmarks/results/paac_vs_sb3_pong_cuda.json
step 150 env-limit-32 "$py" benchmarks/env_limit.py "${bench[@]}" --envs 32 --workers 8 --section env-limit-cuda-32
step 150 env-limit-64 "$py" benchmarks/env_limit.py "${bench[@]}" --envs 64 --workers 16 --section env-limit-cuda-64
step 60 paac-128 "$py" benchmarks/env_limit.py "${bench[@]}" --envs 128 --workers 16 --archs paac \
    --section env-limit-cuda-128
for layout in "16 16" "64 16"; do
    set -- $layout
    step 80 "overlap-$1" "$py" benchmarks/paac_overlap.py --settings pong --device cuda --envs "$1" --workers "$2" \
        --pong-seconds 20 --repeats 1 --out "benchmarks/results/paac_overlap_cuda_$1.json"
done
step 90 profile "$py" benchmarks/profile_pong_step.py --device cuda --envs 32 --workers 8 --steps 20000
pong_start=$SECONDS
for run in seed/vtrace impact/impact paac/a2c; do  # the three archs that issue 15 holds to +18 on a GPU
    name="pong-${run/\//-}" results="benchmarks/results/pong-gpu-${run/\//-}"
    [[ "$only" == "  " || "$only" == *" $name "* ]] || continue
    start=(--arch "${run%/*}" --algo "${run#*/}" --env ALE/Pong-v5 --seed 1 --out "/tmp/$name")
    rm -rf "/tmp/$name"  # from scratch: no run is carried from one lease (or one call) to the next
    seconds=${PONG_SECONDS:-300}
    if [[ -n "${PONG_BUDGET_S:-}" ]]; then
        left=$((PONG_BUDGET_S - (SECONDS - pong_start)))
        ((left < seconds)) && seconds=$left
        ((seconds < 60)) && { echo "=== $name: skipped, ${seconds}s of PONG_BUDGET_S left" | tee -a "$log"; continue; }
    fi
    [[ -n "${PONG_TARGET:-}" ]] && start+=(--target-return "$PONG_TARGET")
    step $((seconds + 60)) "$name" "$py" -m conveyor train "${start[@]}" --time-limit-s "$seconds" --no-progress
    if [[ -f "/tmp/$name/metrics.csv" ]]; then
        "$py" -c "import json, sys; c = json.load(open(sys.argv[1])); print('resolved: device', c['device'],
            'num_envs', c['env']['num_envs'], 'num_workers', c['env']['num_workers'])" "/tmp/$name/config.json" \
            | tee -a "$log"
        # where it stopped: summary.json, or the last metrics row of a run cut off before writing one
        read -r steps ret why < <("$py" -c "import csv, json, os, sys
d = sys.argv[1]
if os.path.isfile(d + '/summary.json'):
    s = json.load(open(d + '/summary.json'))
    steps, ret, why = s['env_steps'], s['return_mean_last100'], s['stop_reason']
else:
    rows = list(csv.DictReader(open(d + '/metrics.csv')))
    last = rows[-1] if rows else {}
    steps, ret, why = int(float(last.get('env_steps', 0))), last.get('return_mean_last100'), 'cut-off'
ret = 'nan' if ret in (None, '') else format(float(ret), '.2f')
print(steps, ret, str(why).replace(' ', '_') or '?')" "/tmp/$name")
        echo "=== $name: stopped at ${steps:-?} env steps, last-100 return ${ret:-?} (${why:-?})" | tee -a "$log"
        [[ -f "$out/pong_runs.tsv" ]] || printf 'utc\trun\tenv_steps\treturn_mean_last100\tstop_reason\n' \
            > "$out/pong_runs.tsv"
        printf '%s\t%s\t%s\t%s\t%s\n' "$(date -u +%FT%TZ)" "$name" "${steps:-?}" "${ret:-?}" "${why:-?}" \
            >> "$out/pong_runs.tsv"
        kept=$("$py" -c "import json, sys; print(int(json.load(open(sys.argv[1]))['env_steps']))" \
            "$results/summary.json" 2>/dev/null || echo 0)
        if [[ "$steps" =~ ^[0-9]+$ ]] && ((kept > steps)); then  # never replace a longer committed run
            results="$results-lease-$(date -u +%Y%m%d)"
            echo "=== $name: results in $results (the committed run reached $kept steps)" | tee -a "$log"
        fi
        mkdir -p "$results" && for f in metrics.csv returns.csv summary.json config.json; do
            [[ -f "/tmp/$name/$f" ]] && cp "/tmp/$name/$f" "$results"/
        done
        tar czf "$out/results.tgz" --exclude=runs docs/benchmarks-log.md benchmarks/results
    fi
done
