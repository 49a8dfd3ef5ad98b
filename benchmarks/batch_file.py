"""Write an OpenAI batch file of N /v1/completions lines with the prompts `polychip bench serving`
sends (its synthetic generator, same seed and lengths), so a `polychip batch` run and a
`bench serving` run do the same work:

    python benchmarks/batch_file.py -n 10000 --input-len 16 --output-len 8 -o /tmp/batch-10k.jsonl
"""
from __future__ import annotations

import argparse
import json

from polychip.bench.datasets import load_tokenizer, synthetic


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--num-lines", type=int, required=True)
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--distinct", type=int, default=1000,
                   help="distinct prompts, repeated in turn (the tokenizer sizes each one; 100k is slow)")
    p.add_argument("-o", "--output", required=True)
    args = p.parse_args()
    prompts = synthetic(load_tokenizer(None), min(args.distinct, args.num_lines), args.input_len, args.output_len,
                        args.seed)
    with open(args.output, "w") as f:
        for i in range(args.num_lines):
            body = {"prompt": prompts[i % len(prompts)].prompt, "max_tokens": args.output_len, "temperature": 0.0,
                    "ignore_eos": True, "min_tokens": args.output_len}
            f.write(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
                                "body": body}) + "\n")


if __name__ == "__main__":
    main()
