# Session 11 call 7: nat-s1-rpb fwd+bwd on default tiles: dQ with the window-layout dS store reading K/V by TMA
# (host descriptors, the default tile's setting) against pointer loads (launch.DQ_TMA_WITH_WINDOW_DS), same process,
# alternating; then per-kernel times of both (torch.profiler).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
S=benchmarks/results/session11
export NAMODELS_FUSED_CACHE=/tmp/none.json
timeout 100 python3 benchmarks/kernel_ab.py nat-s1-rpb --backward --rounds 5 dqtma@set=base \
  --set launch.DQ_TMA_WITH_WINDOW_DS=True > $OUT/c7_ab.txt 2>&1
echo "ab rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| [a-z]|DIFF|Error" $OUT/c7_ab.txt
timeout 60 python3 $S/profile_rpb.py nat-s1-rpb > $OUT/c7_profile.txt 2>&1
timeout 60 python3 -c "import runpy,sys; import ops.fused.launch as L; L.DQ_TMA_WITH_WINDOW_DS=True; sys.argv=['x','nat-s1-rpb']; runpy.run_path('$S/profile_rpb.py', run_name='__main__')" >> $OUT/c7_profile.txt 2>&1
echo "profile rc=$? $(( $(date +%s)-T0 ))s"; grep -E "na_|reduce_kernel|Self CUDA time total" $OUT/c7_profile.txt | awk '{print $1, $(NF-4), $(NF-3)}'
