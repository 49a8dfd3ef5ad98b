"""polychip generate --prompt ... [--chat] [--max-tokens N] [--temperature T]"""
from __future__ import annotations

import sys
import time

from polychip.commands.common import add_engine_args, add_log_level_arg, engine_config_from_args, fail, setup_logging
from polychip.errors import PolychipError
from polychip.flags import Parser


def main(argv: list[str]) -> int:
    p = Parser(prog="polychip generate", description=__doc__)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--enable-thinking", choices=["true", "false"], default=None,
                   help="Qwen3 thinking switch, passed to the chat template")
    add_engine_args(p)
    from polychip.flags import add_config_args, config_from_args
    from polychip.package.opening import PackageOptions, engine_config_for
    add_config_args(p, PackageOptions)
    from polychip.trust.options import TrustOptions
    add_config_args(p, TrustOptions)
    add_log_level_arg(p)
    args = p.parse_args(argv)
    setup_logging(args.log_level)
    from polychip.engine.llm import LLM
    from polychip.engine.sampling_params import SamplingParams
    llm = None
    try:
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k)
        t0 = time.perf_counter()
        # a .pcpkg is verified and extracted before anything of it is loaded (on every node)
        config = engine_config_for(engine_config_from_args(args), config_from_args(args, PackageOptions),
                                   config_from_args(args, TrustOptions))
        if config.node_rank > 0:     # this host only runs its worker ranks; node 0 prints the text
            from polychip.engine.rank_workers import run_node
            return run_node(config)
        llm = LLM.from_config(config)
        print(f"[model loaded in {time.perf_counter() - t0:.1f}s]", file=sys.stderr)
        if args.chat:
            msgs = ([{"role": "system", "content": args.system}] if args.system else [])
            msgs.append({"role": "user", "content": args.prompt})
            kw = {} if args.enable_thinking is None else {"enable_thinking": args.enable_thinking == "true"}
            out = llm.chat(msgs, sp, chat_template_kwargs=kw)[0]
        else:
            out = llm.generate(args.prompt, sp)[0]
    except PolychipError as e:
        return fail(e)
    finally:
        if llm is not None:
            llm.shutdown()
    print(out.text)
    tpot = f"{out.tpot * 1000:.1f} ms" if out.tpot else "n/a"
    print(f"[{len(out.token_ids)} tokens, finish={out.finish_reason}, ttft={out.ttft:.2f}s, "
          f"tpot={tpot}]", file=sys.stderr)
    return 0
