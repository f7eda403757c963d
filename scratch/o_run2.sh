set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 scratch/o_ab.py --budget 95 --only "dot bf32 bk1024 br256,dot bf32 bk1024 br128,dot bf32 bk1024 br512,dot bf32 bk512 br256 w8 s3" 2>&1 | tee $OUT/log.txt
XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 100 ncu --clock-control none \
  --kernel-name regex:fused_moe --metrics gpu__time_duration.sum,smsp__inst_executed.sum,launch__registers_per_thread,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active \
  python3 scratch/o_ncu.py 2>&1 | tee $OUT/ncu.txt | grep -v "^==PROF==" | tail -80
