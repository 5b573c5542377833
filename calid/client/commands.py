"""``calid client``: one request to a running calid server, streamed to the terminal."""
from __future__ import annotations

import sys


def add_parser(sub) -> None:
    from calid.decoding.modes import MODES

    p = sub.add_parser("client", help="send a prompt to a running calid server (calid serve)")
    p.add_argument("prompt", nargs="?", help="the prompt (omit with --models or --health)")
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--app", default="calid", help="Serve application name (default calid)")
    p.add_argument("--model", default="", help="the served model (a multi-model server: one listed by --models; "
                   "default: the server's first)")
    p.add_argument("--mode", default="", choices=("",) + MODES, help="decoding mode (default: the server's)")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--threshold", type=float, default=None)
    p.add_argument("--gamma", type=int, default=None)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds (default 600)")
    p.add_argument("--api-key", default=None, help="API key for a server that requires one (default: $CALID_API_KEY)")
    p.add_argument("--tls", nargs="?", const=True, default=False, metavar="CA_PEM",
                   help="connect over TLS (system roots, or the CA certificate file given)")
    p.add_argument("--local-draft", default=None, metavar="MODEL",
                   help="run the draft here (a preset such as qwen2.5-coder-0.5b-instruct, a .gguf, or self:N): "
                        "modes filter and speculative (the default with it) then use Collaborate, and the server "
                        "only filters and verifies")
    p.add_argument("--models", action="store_true", help="list the server's models and modes")
    p.add_argument("--health", action="store_true", help="print the server's health")
    p.set_defaults(func=cmd_client)


def cmd_client(args) -> int:
    from calid.client import Unauthenticated, Unavailable
    from calid.errors import CalidError

    try:
        return _run(args)
    except Unavailable as e:
        raise CalidError(
            f"no calid server answers at {args.address} (start one with: calid serve): {e.details}"
        ) from None
    except Unauthenticated as e:
        raise CalidError(
            f"the server at {args.address} refused the API key (--api-key or $CALID_API_KEY): {e.details}"
        ) from None
    except ValueError as e:  # an unreadable --tls certificate
        raise CalidError(str(e)) from None


def _run(args) -> int:
    from calid.client import Client
    from calid.errors import CalidError

    with Client(args.address, app=args.app, timeout=args.timeout, api_key=args.api_key, tls=args.tls,
                local_draft=args.local_draft) as c:
        if args.health:
            h = c.health()
            print(f"serving={h.serving} active={h.active_requests} queued={h.queued_requests}/{h.queue_capacity}")
            return 0
        if args.models:
            m = c.list_models()
            for info in m.models:
                served = (f"  served as {info.served_as!r}, modes {', '.join(info.modes)} (default {info.default_mode})"
                          if info.served_as else "")
                print(f"{info.role:7} {info.name}  vocab {info.vocab_size}  context {info.max_position}{served}")
            print(f"modes: {', '.join(m.modes)} (default {m.default_mode})")
            return 0
        if not args.prompt or not args.prompt.strip():
            raise CalidError("prompt is empty")
        stats = {}
        for chunk in c.stream(args.prompt, model=args.model, mode=args.mode, max_new_tokens=args.max_new_tokens,
                              temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                              threshold=args.threshold, gamma=args.gamma, stop=args.stop):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            stats = chunk.stats or stats
        print(file=sys.stderr)
        print(describe_stats(stats, edge=bool(args.local_draft) and stats.get("mode") in ("filter", "speculative")),
              file=sys.stderr)
    return 0


def describe_stats(s: dict, edge: bool = False) -> str:
    return (
        f"[{s.get('mode')}{' at the edge' if edge else ''}: {s.get('output_tokens')} tokens, "
        f"{s.get('tokens_per_s', 0):.2f} tok/s, "
        f"first token {s.get('ttft_ms', 0):.0f} ms, from draft {s.get('filtered_fraction', 0):.0%}, "
        f"target calls {s.get('target_calls')}]"
    )
