# The start every verification pipeline shares; sourced, with run_dir set, from the repository
# root: records this process for verify.sh, defines `step` (a timestamped progress line), the
# steps two pipelines share (`zoo`, `e2e`, and BF16_MODULES for prebuild.py --only), runs
# scripts/gpu/setup.sh and writes the machine's facts to $run_dir/env.txt. Returns non-zero
# when the setup failed.
echo $$ >"$run_dir/pid"  # verify.sh watches this process
step() { echo "[$(date +%T) +${SECONDS}s] $*"; }

# the modules the bf16 conformance runs, the zoo and the timing steps load
BF16_MODULES='^fa3 bfloat16 d(64|128|256) posenc=NONE$|^fa2 bfloat16 d(64|128|256) posenc=ROPE_LLAMA$|^rope'

zoo() {  # zoo NAME HEAD_DIM TIMEOUT: every class in bf16 on cuda
    ZOO_DEVICE=cuda ZOO_BF16_ALL=1 ZOO_HEAD_DIM=$2 ZOO_RESULTS="$run_dir/$1.json" \
        timeout "$3" python3 -m pytest -q -p no:cacheprovider -rfE tests/zoo -k test_bf16 \
        >"$run_dir/$1.log" 2>&1
    step "$1 rc=$? $(tail -1 "$run_dir/$1.log")"
}

e2e() {  # e2e MODEL...: one process each, so a model cut short loses only itself
    local model
    for model in "$@"; do
        timeout "${E2E_TIMEOUT:-120}" python3 scripts/gpu/e2e_models.py \
            --out "$run_dir/e2e-$model" --models "$model" --warmup 2 --runs 5 \
            >"$run_dir/e2e-$model.log" 2>&1
        step "e2e $model rc=$?"
        tail -3 "$run_dir/e2e-$model.log"
    done
}

step "setup"
if . scripts/gpu/setup.sh; then
    {
        nvidia-smi
        python3 -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version)"
        nvcc --version | tail -1
        ninja --version
    } >"$run_dir/env.txt" 2>&1
else
    false
fi
