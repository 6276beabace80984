"""Quality evaluation of state formats: drift probe (excess NLL), perplexity, greedy generation, method table.

- probe.py:   Appendix E drift probe, prefill perplexity and greedy generation, all methods in one batch
- methods.py: method names -> per-layer codecs (registry codecs and calibrated plans) and their bytes
- run.py:     evaluate models and assemble the record behind the table
- report.py:  markdown table, JSON record and excess-NLL plots
- settings.py: the probe's default sizes (the paper's and --quick)
- cli.py:     ``stepquant eval`` (the committed table in docs/results/, see docs/eval.md)

Import from the submodules (probe and run need transformers; this package itself imports nothing heavy).
"""
