# The start every verification pipeline shares; sourced, with run_dir set, from the repository
# root: records this process for verify.sh, defines `step` (a timestamped progress line), runs
# scripts/gpu/setup.sh and writes the machine's facts to $run_dir/env.txt. Returns non-zero
# when the setup failed.
echo $$ >"$run_dir/pid"  # verify.sh watches this process
step() { echo "[$(date +%T) +${SECONDS}s] $*"; }

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
