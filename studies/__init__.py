"""Studies: measurements that informed stepquant's choices, built on the library (they copy none of it).

    python -m studies.attribution --model kda --bits 4 --quick --out docs/results   # error attribution
    OUT=DIR RUNS="kda-4 gdn-4" bash benchmarks/quantizer_ablation.sh                # quantizer swaps, GPU
    python -m studies.grid_probe --model gdn --out docs/results                     # mid-rise vs mid-tread
    python -m studies.codec_study                                                   # dual-axis defaults

Run them from the repository root (they are not installed with the package); each writes its JSON /
markdown into docs/ and prints one JSON line last.
"""
