"""Command line: ``ztunnel proxy ztunnel`` (what the Helm chart runs), ``ztunnel version``.

This is the only place that picks uvloop; everything else runs on any asyncio loop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import resource
import signal
import sys
from collections.abc import Callable, Sequence

from ztunnel import __version__
from ztunnel.config import Config, ConfigError

log = logging.getLogger("ztunnel.cli")

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_CONFIG = 2
EXIT_FORCED = 130


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
    return p


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


async def _run_proxy(config: Config) -> int:
    from ztunnel.app import App, StartupError

    app = App(config)
    loop = asyncio.get_running_loop()
    interrupts = 0

    def on_signal(sig: signal.Signals) -> None:
        nonlocal interrupts
        if sig == signal.SIGINT:
            interrupts += 1
            if interrupts > 1:
                log.warning("second interrupt: exiting now")
                os._exit(EXIT_FORCED)
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
    """SIGUSR1: log task, fd and connection counts (leak checks, debugging a live process)."""
    from ztunnel.app import App

    assert isinstance(app, App)
    log.info("runtime stats", extra={"fields": app.runtime_stats()})


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "version":
        info = version_info()
        if args.json:
            print(json.dumps(info))
        else:
            print(" ".join(f"{k}={v}" for k, v in info.items()))
        return EXIT_OK
    if args.command != "proxy":
        _parser().print_help()
        return EXIT_CONFIG

    from ztunnel import logs

    try:
        config = Config.from_env(os.environ)
        logs.setup(config.log_format, config.rust_log)
    except (ConfigError, ValueError) as e:
        print(f"ztunnel: invalid configuration: {e}", file=sys.stderr)
        return EXIT_CONFIG
    _raise_nofile_limit()
    with asyncio.Runner(loop_factory=_loop_factory(args.loop)) as runner:
        return runner.run(_run_proxy(config))
