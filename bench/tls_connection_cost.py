"""What one open TLS connection costs the operator's listener, in memory and CPU.

    .venv/bin/python bench/tls_connection_cost.py [--connections 1024]

For each certificate (RSA-2048, ECDSA P-256) and TLS read buffer (asyncio's 256 KiB, the
listener's :data:`sdc_operator.listeners.TLS_READ_BUFFER`): a server process with a
:class:`sdc_operator.listeners.GuardedSite` answering ``POST /v1/reports`` at once, and
``--connections`` TLS connections from distinct loopback addresses (127.0.x.y), each
sending one request and holding its connection open. Prints one JSON line per case: the
server's RSS growth per connection and its CPU per connection (handshake and one request).
The client shares the machine's cores with the server; its CPU is not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BODY = b'{"kind":"heartbeat"}' + b" " * 600


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def certificates(directory: Path, algorithm: str) -> tuple[Path, Path, Path]:
    """A CA and a certificate for 127.0.0.1: (CA certificate, certificate, key)."""
    new_key = (
        ["-newkey", "rsa:2048"]
        if algorithm == "rsa"
        else ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"]
    )
    ca_key, ca, key, csr, cert, ext = (
        directory / f"{algorithm}-{n}" for n in ("ca.key", "ca.crt", "key", "csr", "crt", "ext")
    )
    ext.write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    for args in (
        ["req", "-x509", *new_key, "-nodes", "-days", "1", "-subj", "/CN=ca",
         "-keyout", str(ca_key), "-out", str(ca)],
        ["req", *new_key, "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", str(key),
         "-out", str(csr)],
        ["x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
         "-CAcreateserial", "-days", "1", "-extfile", str(ext), "-out", str(cert)],
    ):  # fmt: skip
        subprocess.run(["openssl", *args], check=True, capture_output=True)
    return ca, cert, key


async def serve(cert: str, key: str, buffer: int, port: int) -> None:
    sys.path.insert(0, str(ROOT / "operator"))
    from aiohttp import web

    from sdc_operator import listeners

    listeners._SSLProtocol.max_size = buffer

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"accepted": "heartbeat"}, status=202)

    app = web.Application()
    app.router.add_post("/v1/reports", answer)
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=60)
    await runner.setup()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    site = listeners.GuardedSite(
        runner, "127.0.0.1", port, ssl_context=context, handshake_seconds=30,
        handshakes_per_source=10**6, name="intake",
        connections=listeners.Connections(max_connections=10**6),
    )  # fmt: skip
    await site.start()
    print("ready", flush=True)
    await asyncio.Event().wait()


async def clients(ca: Path, port: int, count: int) -> tuple[list[Any], float]:
    trust = ssl.create_default_context(cafile=str(ca))
    gate = asyncio.Semaphore(256)

    async def one(i: int) -> Any:
        async with gate:
            source = f"127.0.{1 + i // 250}.{1 + i % 250}"
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, ssl=trust, local_addr=(source, 0)
            )
            writer.write(
                b"POST /v1/reports HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY
            )
            assert (await reader.readline()).startswith(b"HTTP/1.1 202")
            return writer

    began = time.monotonic()
    writers = await asyncio.gather(*(one(i) for i in range(count)))
    return writers, time.monotonic() - began


def measure(algorithm: str, buffer: int, count: int, tmp: Path) -> dict[str, Any]:
    ca, cert, key = certificates(tmp, algorithm)
    port = 18443
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(cert), str(key), str(buffer), str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        rss, cpu = rss_mib(server.pid), cpu_seconds(server.pid)

        async def run() -> tuple[float, float]:
            writers, took = await clients(ca, port, count)
            await asyncio.sleep(0.5)
            held = rss_mib(server.pid)
            for writer in writers:
                writer.close()
            await asyncio.gather(*(w.wait_closed() for w in writers), return_exceptions=True)
            return held, took

        held, took = asyncio.run(run())
        return {
            "certificate": {"rsa": "RSA-2048", "ec": "ECDSA P-256"}[algorithm],
            "tls_read_buffer": buffer,
            "connections": count,
            "idle_rss_mib": round(rss, 1),
            "held_rss_mib": round(held, 1),
            "kib_per_connection": round((held - rss) * 1024 / count, 1),
            "server_cpu_ms_per_connection": round((cpu_seconds(server.pid) - cpu) * 1e3 / count, 2),
            "clients_s": round(took, 2),
        }
    finally:
        server.kill()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=1024)
    parser.add_argument("--serve", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        cert, key, buffer, port = args.serve
        asyncio.run(serve(cert, key, int(buffer), int(port)))
        return
    sys.path.insert(0, str(ROOT / "operator"))
    from sdc_operator.listeners import TLS_READ_BUFFER

    with tempfile.TemporaryDirectory() as tmp:
        for algorithm in ("rsa", "ec"):
            for buffer in (256 * 1024, TLS_READ_BUFFER):
                print(json.dumps(measure(algorithm, buffer, args.connections, Path(tmp))))


if __name__ == "__main__":
    main()
