"""The paper's mechanism analyses on any supported model: `stepquant analyze` and docs/analysis.md.

- mechanisms.py: one function per analysis (lifetime vs error, native feedback vs the exact-read oracle,
  the row-impact identity and perplexity experiment, state geometry, lifetime ranks across texts, where
  a plan's bits went), on captured recurrences and calibration arrays
- plots.py:      the figures (PNG)
- run.py:        the command's pipeline: capture once, run every analysis, write analysis.json + figures
- cli.py:        ``stepquant analyze``

Import from the submodules (run needs transformers; this package itself imports nothing heavy).
"""
