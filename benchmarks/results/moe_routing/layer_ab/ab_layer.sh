# Whole MoE layer, forward, before (1c0cdb5's package, out/exp/head) and after (this tree), twice each.
mkdir -p $OUT/ab
ROOT=$PWD
for i in 1 2; do
  for side in old new; do
    if [ $side = old ]; then P=$ROOT/out/exp/head; else P=$ROOT; fi
    (cd $P && PYTHONPATH=$P timeout 150 python3 -c "import flashmoe_science, sys; print(flashmoe_science.__file__)" && \
     PYTHONPATH=$P timeout 150 python3 -m flashmoe_science bench moe --impls ours fp8 --shapes qwen3-30b-a3b \
       deepseek-v2-lite mixtral-8x7b --tokens 256 4096 16384 --no-plot --out $OUT/ab/$side$i 2>&1 | grep -v Warn | tail -1)
    mv $OUT/ab/$side$i/moe*.json $OUT/ab/${side}$i.json 2>/dev/null; rmdir $OUT/ab/$side$i
  done
done
ls $OUT/ab
