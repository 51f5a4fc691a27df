"""Where greedy decoding leaves the true key: the rank of each answer token, per trial.

Not part of CI (one pass over the cell's shared prefix, then each trial's suffix: about five
minutes of one core for SmolLM2's 8192-token cell). For one cell of the passkey measure
(:func:`companion.passkey.passkey_prompts`, the same keys and prompts as the stored run), it
feeds each prompt followed by its true answer and records, at every answer position, the
true token's probability and rank and the model's top token, with plain RoPE at the
model's native positions::

    python tools/passkey_answer_ranks.py --model smollm2 --length 8192 --depth 0.9 \\
        --out chapters/data/10_passkey_answer_ranks.json

Chapter 10 reads the file to say why exact match misses where the gain says the key is known.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from companion.llama import KVCache  # noqa: E402
from companion.longctx_runs import MODELS, load_subject  # noqa: E402
from companion.passkey import FORMATS, _common_prefix, passkey_prompts  # noqa: E402
from companion.utils import save_result  # noqa: E402


def _feed(model, cache: KVCache, ids: list[int], chunk: int) -> torch.Tensor:
    """Hidden states of the last token of each chunk's feed, for ``ids`` after ``cache``."""
    out = None
    for s in range(0, len(ids), chunk):
        out = model.hidden(torch.tensor([ids[s:s + chunk]]), cache)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=list(MODELS), default="smollm2")
    ap.add_argument("--format", choices=FORMATS, default="classic")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--depth", type=float, default=0.9)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--controls", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--top", type=int, default=3, help="top tokens kept per answer position")
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    model, tok, template = load_subject(args.model)
    if args.length > model.config.context_length:
        ap.error(f"--length {args.length} is past the model's native {model.config.context_length} tokens")
    keys, prompts, answers = passkey_prompts(tok, args.format, args.length, args.depth, trials=args.trials,
                                             controls=args.controls, seed=args.seed, template=template)
    # the filler before the key, fed once; each trial feeds at least its last token
    shared = min(_common_prefix(prompts), min(map(len, prompts)) - 1)
    trials = []
    with torch.no_grad():
        cache = KVCache(model.config.n_layers)
        _feed(model, cache, prompts[0][:shared], args.chunk)
        for i, ((key, _), ids, cands) in enumerate(zip(keys, prompts, answers)):
            cache.truncate(shared)
            answer = cands[0]
            h_prompt = _feed(model, cache, ids[shared:], args.chunk)[:, -1:]
            h_answer = model.hidden(torch.tensor([answer[:-1]]), cache) if len(answer) > 1 else h_prompt[:, :0]
            logp = torch.log_softmax(model.logits(torch.cat((h_prompt, h_answer), 1))[0].double(), -1)
            positions = []
            for j, t in enumerate(answer):
                top = logp[j].topk(args.top)
                positions.append({
                    "token": tok.decode([t]), "p": float(logp[j, t].exp()),
                    "rank": int((logp[j] > logp[j, t]).sum()) + 1,
                    "top": [[tok.decode([int(x)]), float(v.exp())] for v, x in zip(top.values, top.indices)],
                })
            first_miss = next((j for j, p in enumerate(positions) if p["rank"] != 1), None)
            logp_key = float(sum(logp[j, t] for j, t in enumerate(answer)))  # the stored run's logp_key
            trials.append({"trial": i, "key": key, "prompt_tokens": len(ids), "logp_key": logp_key,
                           "first_miss": first_miss, "positions": positions})
            print(f"trial {i} key {key}: first miss {first_miss}; "
                  + " ".join(f"{p['token']!r}:{p['rank']}" for p in positions), flush=True)
    data = {"model": args.model, "format": args.format, "length": args.length, "depth": args.depth,
            "trials": args.trials, "controls": args.controls, "seed": args.seed, "shared_prefix_tokens": shared,
            "method": "none", "rows": trials}
    save_result(args.out, data, command="python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *sys.argv[1:]]))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
