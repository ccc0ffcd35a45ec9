"""Speculative decoding with a target and a drafter (speculative) and the held-out prompts it is evaluated on (eval_prompts)."""
