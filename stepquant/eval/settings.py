"""The drift probe's default sizes: what `stepquant eval` (--quick or not) and the studies run.

The paper's probe (Appendix E) prefills P = 2048 tokens natively and scores D = 6144 forced decode updates;
--quick is sized so both shipped models run every default method in under 30 minutes on 2 CPU cores.
Greedy generation continues the first gen_prompt_tokens of gen_prompts documents per stream until EOS or
gen_max_new tokens.
"""

DEFAULT_WINDOW = 256  # first / last decode predictions reported, as in the paper
DEFAULT_BLOCK = 64  # decode predictions per block for the standard error of the mean excess NLL
FULL = {"prefill": 2048, "decode": 6144, "segments": 1, "gen_prompts": 4, "gen_prompt_tokens": 32,
        "gen_max_new": 1024}
QUICK = {"prefill": 512, "decode": 1024, "segments": 1, "gen_prompts": 2, "gen_prompt_tokens": 32,
         "gen_max_new": 128}
SHIPPED_STREAMS = ("wiki", "sotu", "brown")  # the held-out streams of stepquant.data
