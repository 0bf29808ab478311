"""Command line: ``ztunnel proxy ztunnel`` (what the Helm chart runs; also what no command
means, as in Rust), ``ztunnel version``, ``ztunnel help``, ``ztunnel explain`` (offline
authorization explain against a local config file) and ``ztunnel top`` (a live view of a running
ztunnel's connections, from its admin port; see :mod:`ztunnel.top`).

``ztunnel explain --config FILE --dst DST --port N [--src SRC] [--src-ip IP] [--json]`` loads a
local config (the Rust YAML shape, as ``LOCAL_XDS_PATH``; default: ``$LOCAL_XDS_PATH``) and
prints which policies apply to the connection, whether each matched and why, and the decision
(the query syntax is the admin endpoint's ``/debug/authz``, see ``ztunnel.admin.explain``).
Exit status: 0 allowed, 1 denied, 2 bad usage, an unreadable/invalid config or an unknown
workload.

This is the only place that picks uvloop; everything else runs on any asyncio loop.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import logging
import os
import platform
import resource
import signal
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ztunnel import __version__
from ztunnel.config import Config, ConfigError

if TYPE_CHECKING:
    from ztunnel.workers.zygote import Zygote

log = logging.getLogger("ztunnel.cli")

EXIT_OK = 0
EXIT_FAILURE = 1  # (Rust: main returned an error, an unknown command; also a bad setting)
EXIT_CONFIG = 2  # ztunnel explain's bad input
COMMANDS = ("proxy", "version", "help", "top", "explain")


def version_info() -> dict[str, str]:
    return {
        "version": __version__,
        "python": platform.python_version(),
        "implementation": "ztunnel-py",
        "platform": f"{platform.system().lower()}/{platform.machine()}",
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ztunnel",
        description="Istio ambient mesh node proxy (ztunnel), in Python. "
        "Configured by environment variables, like the Rust ztunnel (see README).",
    )
    p.add_argument("--version", action="version", version=f"ztunnel {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    proxy = sub.add_parser("proxy", help="run the proxy (the Helm chart passes: proxy ztunnel)")
    proxy.add_argument("kind", nargs="?", default="ztunnel", choices=["ztunnel"], help="proxy kind")
    proxy.add_argument(
        "--loop",
        choices=["uvloop", "asyncio"],
        default=os.environ.get("ZTUNNEL_EVENT_LOOP", "uvloop"),
        help="event loop implementation (default uvloop; env ZTUNNEL_EVENT_LOOP)",
    )
    ver = sub.add_parser("version", help="print version information")
    ver.add_argument("--json", action="store_true", help="print as JSON")
    hp = sub.add_parser("help", help="print the commands and the version")
    hp.add_argument("topic", nargs="?", help="a command to show the options of")
    top = sub.add_parser(
        "top",
        help="live view of a running ztunnel's connections (admin port)",
        description="A live view of a running ztunnel's connections, read from its admin port "
        "(/debug/connections) every second: identities, age, bytes and rates, sorted and "
        "filtered. --once prints one table and exits.",
    )
    from ztunnel.top import add_arguments as _top_arguments

    _top_arguments(top)
    ex = sub.add_parser(
        "explain",
        help="explain the authorization decision for a connection (local config file)",
        description="Load a local config file (the LOCAL_XDS_PATH YAML) and explain whether a "
        "connection to a workload is allowed: every applicable policy, whether it matched and "
        "why. Exit status: 0 allowed, 1 denied, 2 bad input (usage, config, unknown workload).",
    )
    ex.add_argument(
        "--config",
        default=os.environ.get("LOCAL_XDS_PATH"),
        help="local config YAML (default: $LOCAL_XDS_PATH)",
    )
    ex.add_argument(
        "--src",
        default="",
        help="client: a SPIFFE id (mTLS), an IP (plaintext), or a workload uid or namespace/name "
        "(mTLS as that workload); default: plaintext from an unknown IP",
    )
    ex.add_argument("--src-ip", default="", help="client IP (overrides the one --src implies)")
    ex.add_argument("--dst", required=True, help="destination workload: uid, namespace/name or IP")
    ex.add_argument("--port", required=True, help="destination port after target-port resolution")
    ex.add_argument("--network", default="", help='network for IP lookups (default: "")')
    ex.add_argument("--json", action="store_true", help="print the explanation as JSON")
    return p


def _explain(args: argparse.Namespace) -> int:
    """``ztunnel explain``: 0 allowed, 1 denied, 2 bad input."""
    from ztunnel.admin.explain import explain_query
    from ztunnel.state.localconfig import load_local_config
    from ztunnel.state.store import State

    if not args.config:
        print("ztunnel explain: --config (or LOCAL_XDS_PATH) is required", file=sys.stderr)
        return EXIT_CONFIG
    try:
        with open(args.config, encoding="utf-8") as f:
            text = f.read()
        state = State()
        load_local_config(text, args.config).apply_to(state)
        params = {
            "src": args.src,
            "src_ip": args.src_ip,
            "dst": args.dst,
            "port": args.port,
            "network": args.network,
        }
        explanation = explain_query(state, params)
    except (OSError, ValueError, LookupError) as e:
        print(f"ztunnel explain: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if args.json:
        print(json.dumps(explanation.to_dict(), indent=2))
    else:
        print(explanation)
    return EXIT_OK if explanation.decision.allowed else EXIT_FAILURE


def _loop_factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop]:
    if kind == "uvloop":
        try:
            import uvloop

            return uvloop.new_event_loop
        except ImportError:  # pragma: no cover - uvloop is a hard dependency
            log.warning("uvloop is not installed; using the stdlib event loop")
    return asyncio.new_event_loop


def _raise_nofile_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _fork_zygote(config: Config, loop: str) -> Zygote | None:
    """After the data plane's imports, whose objects then stay out of the collector: with
    ZTUNNEL_WORKER_THREADS >= 2, the process workers are forked from, made now (before the
    event loop and any socket), whose pages the supervisor and every worker then share."""
    import ztunnel.app

    if config.dns_proxy:
        import ztunnel.dns.server  # noqa: F401
    if loop == "uvloop":
        import uvloop  # noqa: F401
    # The collector's passes would write to every page holding an imported object and unshare
    # it from the workers (Python docs, gc.freeze); with one process, they would walk them all
    # on every full pass for nothing (a 200k-pod snapshot was served 0.4 s sooner, 3%: the
    # median of four pairs of benchmarks/scale.py runs with 1 worker, 10.4 against 10.7 s).
    gc.freeze()
    if config.num_worker_threads < 2:
        return None
    from ztunnel.workers import worker
    from ztunnel.workers.zygote import Zygote

    return Zygote.fork(functools.partial(worker.main, loop=loop))


async def _run_proxy(config: Config, zygote: Zygote | None = None) -> int:
    from ztunnel.app import App, StartupError

    app = App(config, spawner=zygote)
    loop = asyncio.get_running_loop()
    interrupts = 0

    def on_signal(sig: signal.Signals) -> None:
        nonlocal interrupts
        if sig == signal.SIGINT:
            interrupts += 1
            if interrupts > 1:  # Rust imp::shutdown: its words, and exit code 0
                log.info("Double Ctrl+C, exit immediately")
                logging.shutdown()  # the buffered log lines first (logs.BatchingHandler)
                os._exit(EXIT_OK)
        log.info("received %s, starting graceful drain", sig.name)
        app.request_stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    loop.add_signal_handler(signal.SIGUSR1, _log_runtime_stats, app)
    try:
        await app.start()
    except (StartupError, OSError) as e:
        log.error("failed to start: %s", e)
        await app.shutdown()
        return EXIT_FAILURE
    log.info("ztunnel ready")
    await app.wait_stopped()
    await app.shutdown()
    log.info("shutdown complete")
    return EXIT_OK


def _log_runtime_stats(app: object) -> None:
    """SIGUSR1: log task, fd and connection counts (leak checks, debugging a live process);
    with data-plane workers, summed over every process."""
    from ztunnel.app import App

    assert isinstance(app, App)

    async def report() -> None:
        log.info("runtime stats", extra={"fields": await app.total_runtime_stats()})

    task = asyncio.get_running_loop().create_task(report())
    _reports.add(task)
    task.add_done_callback(_reports.discard)


_reports: set[asyncio.Task[None]] = set()


def _help(topic: str | None) -> int:
    """Rust ``help()``: the commands and the version; ``ztunnel help <command>``: its options."""
    parser = _parser()
    if topic:
        subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        if topic not in subs.choices:
            print(f"unknown command: {topic}", file=sys.stderr)
            return EXIT_FAILURE
        subs.choices[topic].print_help()
        return EXIT_OK
    print(
        f"\nIstio Ztunnel ({_build_info_line()})\n\n"
        "Commands:\n"
        "proxy (default) - Start the ztunnel proxy\n"
        "version         - Print the version of ztunnel\n"
        "help            - Print commands and version of ztunnel\n"
        "explain         - Explain the authorization decision for a connection (local config)\n"
        "top             - Live view of a running ztunnel's connections (admin port)"
    )
    return EXIT_OK


def _build_info_line() -> str:
    """Rust ``BuildInfo``'s Display: ``version.BuildInfo{Version:"..", GitRevision:"..", ...}``."""
    from ztunnel.admin.admin import build_info, istio_version_from_env

    info = build_info(istio_version_from_env())
    fields = ", ".join(f'{k[0].upper()}{k[1:]}:"{v}"' for k, v in info.items() if k != "gitTag")
    return f"version.BuildInfo{{{fields}}}"


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        # Rust main: "unknown command: X", the help, exit 1 (argparse would say more, exit 2)
        print(f"unknown command: {argv[0]}", file=sys.stderr)
        _help(None)
        return EXIT_FAILURE
    args = _parser().parse_args(argv)
    if args.command is None:  # Rust: no command runs the proxy
        args = _parser().parse_args(["proxy"])
    if args.command == "help":
        return _help(args.topic)
    if args.command == "top":
        from ztunnel import top

        return top.main(args)
    if args.command == "version":  # Rust version(): the BuildInfo line (--json: ours)
        print(json.dumps(version_info()) if args.json else _build_info_line())
        return EXIT_OK
    if args.command == "explain":
        return _explain(args)
    if args.command != "proxy":
        _parser().print_help()
        return EXIT_FAILURE

    from ztunnel import logs

    try:
        config = Config.from_env(os.environ)
        logs.setup(config.log_format, config.rust_log)
    except (ConfigError, ValueError) as e:
        print(f"ztunnel: invalid configuration: {e}", file=sys.stderr)
        return EXIT_FAILURE  # (Rust: parse_config's error returned from main)
    _raise_nofile_limit()
    if config.malloc_tuning:
        from ztunnel.net.malloc import tune_malloc

        tune_malloc()
    zygote = _fork_zygote(config, args.loop)
    with asyncio.Runner(loop_factory=_loop_factory(args.loop)) as runner:
        return runner.run(_run_proxy(config, zygote))
