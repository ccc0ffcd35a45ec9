"""Does SDPA's causal GQA attention pay a one-time cost per new sequence length on this GPU? (issue 16, item 4)

The packed varlen split (dflash/target_runner.py, VARLEN_SOLO_MIN_LENGTH) runs each long sample alone through
``scaled_dot_product_attention(..., is_causal=True, enable_gqa=True)``, so a long-tailed corpus calls it with many
distinct lengths. This times, for 40 lengths never seen before in the process (the 40 smallest of 60 draws from
1,024-8,191 tokens, so about 1,040-6,070; Qwen3-8B heads: 32 query, 8 key/value, head dim 128, bf16), the first call
and the median of 5 later calls of each length, with the default backend choice and then, on 40 further lengths,
with FlashAttention forced, and prints the priority order SDPA reports.
usage: python docs/results/sdpa_new_length_probe.py
"""

import statistics
import time

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backends: list | None) -> None:
    if backends is None:
        scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        with sdpa_kernel(backends):
            scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def timed(*args) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    attend(*args)
    torch.cuda.synchronize()
    return time.perf_counter() - started


def main() -> None:
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(device), torch.__version__)
    print("sdp priority order:", [SDPBackend(b).name for b in torch._C._get_sdp_priority_order()])
    rng = np.random.default_rng(0)
    for label, backends in (("default", None), ("flash forced", [SDPBackend.FLASH_ATTENTION])):
        lengths = sorted(set(int(n) for n in rng.integers(1024, 8192, size=60)))[:40]
        first, later = [], []
        for length in lengths:
            q = torch.randn(1, 32, length, 128, device=device, dtype=torch.bfloat16)
            k, v = (torch.randn(1, 8, length, 128, device=device, dtype=torch.bfloat16) for _ in range(2))
            first.append(timed(q, k, v, backends))
            later.append(statistics.median(timed(q, k, v, backends) for _ in range(5)))
        extra = [a - b for a, b in zip(first, later, strict=True)]
        print(f"{label}: {len(lengths)} new lengths: first call {1e3 * statistics.median(first):.3f} ms median, "
              f"later calls {1e3 * statistics.median(later):.3f} ms median; one-time extra per length "
              f"{1e3 * statistics.median(extra):.3f} ms median, {1e3 * max(extra):.3f} ms max")


if __name__ == "__main__":
    main()
