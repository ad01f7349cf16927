#!/usr/bin/env bash
# One call on the H200 machine: install the carried wheels, run the GPU half of the test suite,
# then the benchmarks. Usage (device tool, carry .whl): bash src/kvdepot/bench/h200_run.sh [steps...]
# steps: tests transfer transfer1b demo ttft ttft4k mp ttftmp ttftrpc hooks tiers stall pieces anatomy layers layerthread bookkeeping movers tp issue19 dma contexts firsthit19 ab19 abin abshapes abmp abdisk goals19 unmet19 anatomy19 cpus arenas
# (default: tests transfer demo ttft mp). Output lands in $OUT. Run from the repository root.
# Retired with tools/ (issue 15; their figures are in docs/perf-notes.md): uva, hybrid, batch
# (tools/uva_probe.py, a Triton mover never adopted); anatomy now runs bench transfer --timeline.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 KVDEPOT_LOG_LEVEL=WARNING
# The C helper (setup.py): carried as src/kvdepot/transfer/_native.abi3.so, or built here where a compiler is;
# without either the Python path runs (the bench titles say which).
ls src/kvdepot/transfer/_native*.so >/dev/null 2>&1 || python3 setup.py -q build_ext --inplace >/dev/null 2>&1 \
  || echo "no C helper: not carried, and it cannot be built here"
steps=${*:-tests transfer demo ttft mp}
OPS256="python3 -m kvdepot.cli bench transfer --mover batch --blocks 256 --reps 15"  # issue 19's 256-block operations
SMALL="--layers 16 --head-dim 64 --tokens-per-block 8"  # its 256 KiB-block shape (the 1B model, 8 tokens a block)
DISK="python3 -m kvdepot.cli bench tiers --parts disk --disk-path /tmp/kvd-disk"
nvidia-smi --query-gpu=name,driver_version,memory.total,uuid --format=csv,noheader | tee "$OUT/device.txt"  # uuid: which host
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/device.txt"  # may name an older commit than the tree carried:
echo "src $(bash src/kvdepot/bench/src_digest.sh)" | tee -a "$OUT/device.txt"  # ... the digest of what ran does not
for step in $steps; do
  echo "=== $step ($(date +%T))"
  case $step in
    tests) python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests > "$OUT/gpu_tests.txt" 2>&1
           grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.txt" | tail -12 ;;
    transfer)
      { python3 -m kvdepot.cli bench transfer --timeline
        python3 -m kvdepot.cli bench transfer --tokens-per-block 8 --timeline
        python3 -m kvdepot.cli bench transfer --layers 16 --head-dim 64 --timeline
        python3 -m kvdepot.cli bench transfer --layers 16 --head-dim 64 --tokens-per-block 8 --timeline
        python3 -m kvdepot.cli bench transfer --layers 16 --head-dim 64 --tokens-per-block 8 --tokens 2048 --timeline
      } 2>&1 | tee "$OUT/transfer.txt" ;;
    movers) for shape in "" "--tokens-per-block 8" "--layers 16 --head-dim 64" "--layers 16 --head-dim 64 --tokens-per-block 8" "--layers 16 --head-dim 64 --tokens-per-block 8 --tokens 2048"; do
              for mover in batch staged; do python3 -m kvdepot.cli bench transfer $shape --mover $mover 2>&1 | grep -E "^(batch|staged) "; done
            done | tee "$OUT/movers.txt" ;;
    transfer1b) python3 -m kvdepot.cli bench transfer --layers 16 --head-dim 64 --tokens-per-block 8 --mover staged 2>&1 | tee "$OUT/transfer1b.txt" ;;
    demo) python3 -m kvdepot.cli demo --model llama-1b --prompt-tokens 8192 2>&1 | tee "$OUT/demo.txt" ;;
    ttft) KVDEPOT_HOST_CAPACITY_GB=48 python3 -m kvdepot.cli bench ttft --plot "$OUT/ttft.png" --json "$OUT/ttft.json" 2>&1 | tee "$OUT/ttft.txt" ;;
    ttft4k) KVDEPOT_HOST_CAPACITY_GB=48 python3 -m kvdepot.cli bench ttft --lengths 4096 2>&1 | tee "$OUT/ttft4k.txt" ;;
    ttftmp) KVD_BENCH_SERVER_LOG=$OUT/server.log KVDEPOT_HOST_CAPACITY_GB=48 python3 -m kvdepot.cli bench ttft --modes mp --lengths ${TTFT_LENGTHS:-4096,16384,32768} 2>&1 | tee "$OUT/ttftmp.txt"
            tail -20 "$OUT/server.log" ;;
    ttftrpc) KVDEPOT_LAYER_PROGRESS=rpc KVDEPOT_HOST_CAPACITY_GB=48 python3 -m kvdepot.cli bench ttft --modes mp \
               --lengths ${TTFT_LENGTHS:-4096,16384,32768} 2>&1 | tee "$OUT/ttftrpc.txt" ;;  # MP hooks by LAYERS (A/B with ttftmp)
    hooks) python3 -m kvdepot.cli bench hooks --rounds 5 2>&1 | tee "$OUT/hooks.txt" ;;  # this host's CPUs: LAYERS vs page
    mp) { python3 -m kvdepot.cli bench mp --lookups 5000
          python3 -m kvdepot.cli bench mp --blocks 64 --lookups 500
        } 2>&1 | tee "$OUT/mp.txt" ;;
    tiers) mkdir -p /tmp/kvd-disk; df -T /tmp/kvd-disk | tail -1
           $DISK 2>&1 | tee "$OUT/tiers.txt" ;;
    stall) mkdir -p /tmp/kvd-disk  # the step loop beside write-behind to disk: lent slots against bytes copies (~1 min)
      python3 -m kvdepot.cli bench tiers --parts stall --disk-path /tmp/kvd-disk 2>&1 | tee "$OUT/stall.txt" | tail -5 ;;
    pieces) mkdir -p /tmp/kvd-disk  # get_into by read setting (MiB:depth), one process, each read paired with a raw read
            python3 -m kvdepot.cli bench tiers --parts disk --disk-path /tmp/kvd-disk --reps ${PIECE_REPS:-6} \
              --read-settings ${PIECES:-2:4,2:8,2:16,4:8,8:4} 2>&1 | tee "$OUT/pieces.txt" ;;
    anatomy) { python3 -m kvdepot.cli bench transfer --mover staged --timeline
               python3 -m kvdepot.cli bench transfer --mover runs --timeline
               python3 -m kvdepot.cli bench transfer --layers 16 --head-dim 64 --tokens-per-block 8 --mover staged --timeline
             } 2>&1 | tee "$OUT/anatomy.txt" ;;
    layers) KVDEPOT_HOST_CAPACITY_GB=48 python3 -m kvdepot.cli bench ttft --modes in-process --lengths ${TTFT_LENGTHS:-4096,32768} \
              --layers-ahead ${LAYERS_AHEAD:-4,64} --rounds 2 --json "$OUT/layers.json" 2>&1 | tee "$OUT/layers.txt" ;;
    layerthread) # in-process loads by layer: the layer thread on and off, alternating in one process (~4 min at 2 rounds)
      KVDEPOT_HOST_CAPACITY_GB=48 python3 -m kvdepot.cli bench ttft --modes in-process --lengths ${TTFT_LENGTHS:-4096,16384,32768} \
        --layer-thread on,off --rounds ${LT_ROUNDS:-2} --repeats ${TTFT_REPEATS:-3} --json "$OUT/layerthread.json" 2>&1 | tee "$OUT/layerthread.txt" ;;
    bookkeeping) python3 -m kvdepot.cli bench bookkeeping 2>&1 | tee "$OUT/bookkeeping.txt" ;;
    tp) KVD_BENCH_SERVER_LOG=$OUT/tp_server.log python3 -m kvdepot.cli bench tp --device cuda --reps 9 2>&1 | tee "$OUT/tp.txt"
        tail -20 "$OUT/tp_server.log" ;;
    issue19) # 256-block operations per shape: the store head off/on, one or two lanes, in one process each
      for shape in "" "--tokens-per-block 8" "--layers 16 --head-dim 64" "--layers 16 --head-dim 64 --tokens-per-block 8"; do
        python3 -m kvdepot.cli bench transfer --mover batch --blocks 256 $shape --store-head-mib ${HEADS:-0,16} --lanes ${LANES:-1,2}
      done 2>&1 | tee "$OUT/issue19.txt"
      python3 -m kvdepot.cli bench bookkeeping 2>&1 | tee "$OUT/bookkeeping.txt" ;;
    contexts) python3 -m kvdepot.cli bench contexts 2>&1 | tee "$OUT/contexts.txt" ;;  # MP's per-layer toll: where the server records
    dma) python3 -m kvdepot.cli bench dma 2>&1 | tee "$OUT/dma.txt" ;;  # the copy engines' ceiling for scattered blocks
    anatomy19) # where a 256-block store's and retrieve's time goes (timing events, no profiler): 256 KiB and 1 MiB blocks
      for shape in "$SMALL" "--tokens-per-block 8"; do
        $OPS256 --anatomy $shape 2>&1 | grep -E "^batch"
      done 2>&1 | tee "$OUT/anatomy19.txt" ;;
    goals19) # every figure issue 19's closing note asks for, in one call (~8 min): transfer rows, TTFT, first hit, disk;
             # the 256 KiB shape in SMALL_PROCS processes (default 3): its idle-GPU rows move 10+ points with the process
      for shape in "" "--tokens-per-block 8" "--layers 16 --head-dim 64" "$SMALL"; do
        procs=1; [ "$shape" = "$SMALL" ] && procs=${SMALL_PROCS:-3}
        for _ in $(seq "$procs"); do
          $OPS256 $shape 2>&1 | grep -E "^(kvdepot bench|batch|NUMA)"
        done
      done 2>&1 | tee "$OUT/goals19_transfer.txt"
      KVDEPOT_HOST_CAPACITY_GB=48 python3 -m kvdepot.cli bench ttft --modes in-process,mp --lengths 4096,16384,32768 \
        --repeats ${TTFT_REPEATS:-3} --rounds ${TTFT_ROUNDS:-2} > "$OUT/goals19_ttft.txt" 2>&1
      grep -E "^(mode|in-process|mp) " "$OUT/goals19_ttft.txt"; grep -A5 "^server mode (mp) over" "$OUT/goals19_ttft.txt"
      python3 -m kvdepot.cli bench firsthit --length 4096 --hits 4 --warmup on --processes ${FIRST_PROCESSES:-3} 2>&1 \
        | tee "$OUT/goals19_firsthit.txt" | tail -7
      mkdir -p /tmp/kvd-disk
      $DISK 2>&1 | tee "$OUT/goals19_disk.txt" | tail -6 ;;
    unmet19) # the two goals still unmet on the H200, alone (~30 s on an H100 host, for a short device window): the 256 KiB shape's
             # 256-block rows in SMALL_PROCS processes (2), then disk get_into over raw reads
      for _ in $(seq ${SMALL_PROCS:-2}); do
        $OPS256 $SMALL 2>&1 | grep -E "^(kvdepot bench|batch|NUMA)"
      done 2>&1 | tee "$OUT/unmet19_transfer.txt"
      mkdir -p /tmp/kvd-disk
      $DISK 2>&1 | tee "$OUT/unmet19_disk.txt" | tail -6 ;;
    firsthit19) # whose is the first hit's toll: the engine's warm-up on/off (a process each), then off with
                # every kernel loaded at start (CUDA_MODULE_LOADING=EAGER): gone there = lazy kernel loading
      { python3 -m kvdepot.cli bench firsthit --length 4096 --hits 4
        CUDA_MODULE_LOADING=EAGER python3 -m kvdepot.cli bench firsthit --length 4096 --hits 4 --warmup off
      } 2>&1 | tee "$OUT/firsthit19.txt" | grep -E "^(on|off) " ;;
    ab19) # 256-block operations per shape, an older tree (OLD_SRC: a copy of its src/, e.g. `git archive REV src |
          # tar -x -C .old19`, carried) and this one, old new new old; AB_SHAPES: the shapes, ';'-separated
      IFS=';' read -ra shapes <<< "${AB_SHAPES:-;--tokens-per-block 8;--layers 16 --head-dim 64;--layers 16 --head-dim 64 --tokens-per-block 8}"
      for shape in "${shapes[@]}"; do
        for tree in "${OLD_SRC:?set OLD_SRC to the src dir of an older tree}" src src "$OLD_SRC"; do
          echo "## $tree $shape"
          PYTHONPATH=/tmp/site:$tree python3 -m kvdepot.cli bench transfer --mover batch --blocks 256 $shape 2>&1 | grep -E "^batch"
        done
      done 2>&1 | tee "$OUT/ab19.txt" ;;
    abin) # the same A/B inside one process (bench ab: both trees' engines over one pool, paired round by round),
          # four processes whose engine built first alternates (OLD_SRC as for ab19; AB_SHAPE: one shape, default 256 KiB)
      for first in new old new old; do
        python3 -m kvdepot.cli bench ab --old "${OLD_SRC:?set OLD_SRC to the src dir of an older tree}" --first $first \
          --rounds ${AB_ROUNDS:-40} ${AB_SHAPE:-} 2>&1 | grep -E "^(kvdepot bench ab|store|retrieve|both) "
      done 2>&1 | tee "$OUT/abin.txt" ;;
    abshapes) # bench ab on each of issue 19's four shapes, two processes each (new built first, then old): the
              # before/after of the issue in one run (OLD_SRC: e.g. the tree at its filing, git archive 188eb7f src)
      for shape in "--layers 32 --head-dim 128 --tokens-per-block 32" "--layers 32 --head-dim 128 --tokens-per-block 8" \
                   "--layers 16 --head-dim 64 --tokens-per-block 32" "--layers 16 --head-dim 64 --tokens-per-block 8"; do
        for first in new old; do echo "--- $shape, $first built first"
          python3 -m kvdepot.cli bench ab --old "${OLD_SRC:?set OLD_SRC to the src dir of an older tree}" --first $first \
            --rounds ${AB_ROUNDS:-20} $shape 2>&1 | grep -E "^(store|retrieve|both) "
        done
      done 2>&1 | tee "$OUT/abshapes.txt" ;;
    abmp) # TTFT in-process and MP, an older tree (OLD_SRC, as for ab19) and this one, old new new old (~6 min):
          # a change to the server's loads by layer, judged where it shows (the server runs the same tree)
      for tree in "${OLD_SRC:?set OLD_SRC to the src dir of an older tree}" src src "$OLD_SRC"; do
        echo "## $tree"
        PYTHONPATH=/tmp/site:$tree KVDEPOT_HOST_CAPACITY_GB=48 python3 -m kvdepot.cli bench ttft --modes in-process,mp \
          --lengths ${TTFT_LENGTHS:-16384,32768} 2>&1 | grep -E "^(mode|in-process|mp) "
      done 2>&1 | tee "$OUT/abmp.txt" ;;
    abdisk) # bench tiers --parts disk, an older tree (OLD_SRC, as for ab19) and this one in alternating processes
            # (~1.5 min): the get_into / put rows of each (issue 19, fifteenth pass: the checksum over block digests)
      mkdir -p /tmp/kvd-disk
      for tree in "${OLD_SRC:?set OLD_SRC to the src dir of an older tree}" src src "$OLD_SRC" "$OLD_SRC" src; do
        echo "## $tree"
        PYTHONPATH=/tmp/site:$tree python3 -m kvdepot.cli bench tiers --parts disk --disk-path /tmp/kvd-disk --reps 3 \
          2>&1 | grep -E "^(tier|disk +(put / write|get_into))"
      done 2>&1 | tee "$OUT/abdisk.txt" ;;
    cpus) # the 256 KiB store's spread from process to process (10+ points): is it where the process runs? The
          # shape in one process per quarter of the CPUs (taskset), CPUS_ROUNDS (2) times around, with the host's CPU layout first;
          # CPUS_HEADS (e.g. 16,64,16): store_head_mib values each process measures in turn (a larger head for slow processes?)
      { lscpu | grep -E "^(Model name|Socket|NUMA|Core|Thread|CPU\(s\))"; nvidia-smi topo -m 2>&1 | head -4
        n=$(nproc); parts=$(( n < 4 ? n : 4 )); q=$(( n / parts ))  # CPUs per process
        for round in $(seq ${CPUS_ROUNDS:-2}); do for k in $(seq 0 $((parts - 1))); do cpus="$((k * q))-$((k * q + q - 1))"; echo "## cpus $cpus"
          taskset -c "$cpus" $OPS256 $SMALL ${CPUS_HEADS:+--store-head-mib $CPUS_HEADS} 2>&1 \
            | grep -E "^kvdepot bench|^NUMA|^batch .*  (store|retrieve)  "
        done; done
      } 2>&1 | tee "$OUT/cpus.txt" ;;
    arenas) # the same question another way: bench ab of this tree against itself (two engines over one pool, each
            # its own pinned arena, paired round by round), three processes: apart within a process = the arena's
            # memory; alike within each but apart between processes = the process
      for _ in 1 2 3; do
        python3 -m kvdepot.cli bench ab --old src --first new --rounds ${AB_ROUNDS:-40} 2>&1 | grep -E "^(kvdepot bench ab|store|retrieve|NUMA:) "
      done 2>&1 | tee "$OUT/arenas.txt" ;;
    uva|hybrid|batch) echo "step $step was retired with tools/uva_probe.py (issue 15): see docs/perf-notes.md" ;;
    *) echo "unknown step $step" ;;
  esac
done
