"""Downstream tasks with a compressed recurrent state, through lm-evaluation-harness (docs/tasks.md).

- harness.py:      the lm-eval model ``stepquant`` (StepquantLM): loglikelihood, loglikelihood_rolling and
                   generate_until with the state in any method's format; ``python -m stepquant.tasks.harness``
                   is lm-eval's command line with it registered
- run.py:          several methods on the same tasks, one table (JSON, markdown, bar plot)
- build.py:        the offline tasks' data from the shipped held-out text
- lm_eval_tasks/:  the offline tasks (YAML, loaders and metrics in utils.py, data/)
- cli.py:          ``stepquant tasks``

Import from the submodules (harness and run need lm-eval: pip install 'stepquant[tasks]').
"""
