"""How far the hidden states a drafter trains on are from the ones it decodes with, per storage dtype.

Training reads the cache: the target run in bfloat16 (extract's dtype on CUDA), stored as bfloat16 (bit-exact) or
float8_e4m3fn with one scale per token and tap (:func:`dflash.cache.format.quantize_fp8`, lossy). Decoding
(``evaluate``, float32 on the H200 runs) computes the taps in float32. For real text through the real target this
prints, per tap (``target_layer_ids``, output of decoder layer l), the relative RMS error against the float32
forward of:

* ``bf16 compute``: the bfloat16 forward, as extract computes it; bfloat16 storage (the default) adds nothing to it;
* ``+ fp8 storage``: that forward quantized to float8_e4m3fn and back (``extract.storage_dtype: fp8``);

over all hidden channels, and without each tap's ``--drop-channels`` channels of largest mean magnitude (the few
outlier channels dominate the norm; the rest is where fp8's 3 mantissa bits show). A storage dtype whose added error
is small against ``bf16 compute`` adds little to what drafters here are already trained through. Runs on CPU (the
bfloat16 forward uses CPU kernels, not CUDA's; the figures are of that size, not identical).

    python benchmarks/storage_error.py                          # embedded SmolLM2, 4 stdlib files x 512 tokens
    python benchmarks/storage_error.py --target PATH --taps 1 8 14 20 27 --tokens 1024
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

import torch

from dflash.cache.format import dequantize_fp8, quantize_fp8
from dflash.target.load import load_target, locate_target

DEFAULT_FILES = ("argparse.py", "json/decoder.py", "textwrap.py", "heapq.py")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="default", help="target folder, .gguf file or 'default' (SmolLM2)")
    parser.add_argument("--taps", type=int, nargs="+", default=[1, 8, 14, 20, 27],
                        help="target_layer_ids (default: the h200-smollm2 preset's 5 taps)")
    parser.add_argument("--files", nargs="+", default=list(DEFAULT_FILES),
                        help="texts to run, relative to the Python standard library or absolute")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per file (its first ones)")
    parser.add_argument("--drop-channels", type=int, default=8, help="outlier channels left out of the second table")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    path = locate_target(args.target)
    exact = load_target(path, dtype=torch.float32)
    half = load_target(path, dtype=torch.bfloat16)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    kinds = ("bf16 compute", "+ fp8 storage")
    squared = {(kind, drop): [0.0] * len(args.taps) for kind in kinds for drop in (False, True)}
    norms = {drop: [0.0] * len(args.taps) for drop in (False, True)}
    tokens = 0
    for name in args.files:
        text = (stdlib / name).read_text(encoding="utf-8")
        ids = torch.tensor([exact.tokenizer(text)["input_ids"][: args.tokens]])
        tokens += ids.shape[1]
        with torch.no_grad():
            reference = exact.model(ids, output_hidden_states=True).hidden_states
            computed = half.model(ids, output_hidden_states=True).hidden_states
        for j, layer in enumerate(args.taps):
            ref = reference[layer + 1][0].float()  # output of decoder layer l = hidden_states[l + 1]
            bf16 = computed[layer + 1][0]
            bits, scale = quantize_fp8(bf16, 1)
            versions = {"bf16 compute": bf16.float(), "+ fp8 storage": dequantize_fp8(bits, scale, 1).float()}
            keep = torch.ones(ref.shape[1], dtype=torch.bool)
            keep[ref.abs().mean(0).topk(args.drop_channels).indices] = False
            for drop, columns in ((False, slice(None)), (True, keep)):
                norms[drop][j] += ref[:, columns].pow(2).sum().item()
                for kind, value in versions.items():
                    squared[(kind, drop)][j] += (value - ref)[:, columns].pow(2).sum().item()

    result = {"target": str(path), "taps": args.taps, "tokens": tokens, "files": args.files,
              "drop_channels": args.drop_channels, "relative_rms_error": {}}
    for drop in (False, True):
        title = "all channels" if not drop else f"without each tap's {args.drop_channels} largest channels"
        print(f"relative RMS error against the float32 forward, {title} ({tokens} tokens)")
        print(f"{'':16s}" + "".join(f"{'tap ' + str(t):>10s}" for t in args.taps))
        table = {}
        for kind in kinds:
            values = [(squared[(kind, drop)][j] / norms[drop][j]) ** 0.5 for j in range(len(args.taps))]
            table[kind] = [round(v, 5) for v in values]
            print(f"{kind:16s}" + "".join(f"{v:10.4f}" for v in values))
        result["relative_rms_error"]["dropped" if drop else "all"] = table
    print(json.dumps(result))


if __name__ == "__main__":
    main()
