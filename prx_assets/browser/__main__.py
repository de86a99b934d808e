"""Start the curation browser: ``python -m prx_assets.browser --data-root data --port 8765``.

Binds 127.0.0.1 by default. ``--host`` may name another interface, but the server still
answers only requests addressed to a loopback name unless ``--allow-host`` lists more
(the DNS-rebinding guard). It never writes: the indexes its queries use are the tables'
own (the write path builds them); at start it warns about any a lab lacks (a lab written
before a spec listed them: the ``lance_maintenance`` job builds them).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from prx_assets.browser.app import LOOPBACK_HOSTS, BrowserApp, make_server
from prx_assets.browser.queries import LabQueries, index_report
from prx_assets.browser.thumbs import ThumbnailCache
from prx_assets.core.lab import Lab, no_lab_at


def _port(text: str) -> int:
    """A TCP port (0: any free one); anything else is a usage error, not a traceback."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text[:40]!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is outside 0-65535")
    return port


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m prx_assets.browser", description=__doc__)
    p.add_argument("--data-root", default=os.environ.get("PRX_DATA_ROOT", "data"))
    p.add_argument("--lab", default=None, help="the Lance lab (default: <data-root>/lab)")
    p.add_argument(
        "--shards",
        default=None,
        help="the shard tree the loader reads, for audit verdicts (default: <data-root>/shards)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8765, help="0: any free port")
    p.add_argument(
        "--allow-host",
        action="append",
        default=[],
        help="another Host header name to answer (repeatable); loopback names always are",
    )
    p.add_argument("--thumb-cache-mb", type=int, default=64)
    p.add_argument("--quiet", action="store_true", help="no per-request log lines")
    return p.parse_args(argv)


def stop_on_sigterm(server) -> None:  # noqa: ANN001 - any socketserver.BaseServer
    """SIGTERM (``docker stop``, systemd, a supervisor) stops the server cleanly, like Ctrl-C.

    Why explicit: a process inherits an ignored or blocked SIGTERM from whoever started it
    (a shell's ``trap '' TERM``, a supervisor's mask), and would then outlive every stop
    request until it is killed. Installing a handler replaces an inherited "ignore", and the
    signal is unblocked. ``shutdown`` waits for ``serve_forever`` to return, so it runs on
    its own thread, not in the handler.
    """

    def _stop(signum: int, frame: object) -> None:
        threading.Thread(target=server.shutdown, name="browser-stop", daemon=True).start()

    signal.signal(signal.SIGTERM, _stop)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    lab_root = args.lab or str(Path(args.data_root) / "lab")
    missing = no_lab_at(lab_root)
    if missing:  # checked before Lab(), which would create an empty lab there
        print(f"error: {missing} (run `make demo` or pass --data-root)", file=sys.stderr)
        return 2
    lab = Lab(lab_root)
    missing = sorted(k for k, v in index_report(lab.view()).items() if v == "missing")
    if missing:
        print(
            f"warning: no index on {', '.join(missing)}: queries still answer, by scanning; "
            "run the lance_maintenance job to build the indexes the table specs declare",
            file=sys.stderr,
        )
    if args.host not in LOOPBACK_HOSTS:
        print(
            f"warning: listening on {args.host}; only Host names "
            f"{sorted(LOOPBACK_HOSTS | set(args.allow_host))} are answered",
            file=sys.stderr,
        )
    app = BrowserApp(
        LabQueries(lab, shards_root=args.shards or str(Path(args.data_root) / "shards")),
        ThumbnailCache(args.thumb_cache_mb * 1024 * 1024),
        allowed_hosts=LOOPBACK_HOSTS | frozenset(args.allow_host),
    )
    try:
        server = make_server(app, args.host, args.port, quiet=args.quiet)
    except OSError as exc:  # the port is taken, the host is not this machine's, ...
        print(
            f"error: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return 2
    host, port = server.server_address[:2]
    shown = f"[{host}]" if ":" in str(host) else host
    print(f"curation browser on http://{shown}:{port}/  (lab {lab_root}; Ctrl-C stops)", flush=True)
    stop_on_sigterm(server)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
