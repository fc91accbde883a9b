#!/usr/bin/env python3
"""fault_proxy.py PORT [--delay-ms D]: the relay between the hosts of the cross-host test.

Runs in the namespace that joins the hosts, where iptables redirects every TCP connection
between them to PORT. For each connection it reads the destination the connector asked for
(SO_ORIGINAL_DST), connects there itself and relays the bytes both ways, each chunk held back
D ms (the link's delay; order is kept). Faults, at any time, by signal:
  SIGUSR1  stall: relay nothing more, keep every connection open (a hung link or switch);
  SIGUSR2  cut: reset every connection and refuse new ones (a cut cable).
SIGTERM ends it after one line on stdout: "relayed C connections, B bytes".
"""

import argparse
import asyncio
import signal
import socket
import struct
import sys

SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h


class Relay:
    def __init__(self, delay_s):
        self.delay_s = delay_s
        self.connections = 0
        self.bytes = 0
        self.stalled = asyncio.Event()  # set: relay nothing more
        self.cut = False
        self.sockets = []  # the writers of both sides of every connection, for the cut

    def reset_all(self):
        self.cut = True
        for writer in self.sockets:
            sock = writer.get_extra_info("socket")
            if sock is not None:
                # linger 0: close() sends a reset, as a link that went away mid-message would
                # look to the next write.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        self.sockets.clear()

    async def pump(self, reader, writer):
        loop = asyncio.get_running_loop()
        queue = asyncio.Queue()

        async def receive():
            while not self.stalled.is_set():
                data = await reader.read(1 << 16)
                if not data:
                    break
                queue.put_nowait((loop.time() + self.delay_s, data))
            queue.put_nowait((0.0, b""))

        async def send():
            while True:
                due, data = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if self.stalled.is_set():
                    await asyncio.Event().wait()  # never again
                if not data:
                    break
                writer.write(data)
                self.bytes += len(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()

        try:
            await asyncio.gather(receive(), send())
        except (ConnectionError, OSError):
            writer.transport.abort()

    async def handle(self, reader, writer):
        if self.cut:
            writer.transport.abort()
            return
        sock = writer.get_extra_info("socket")
        raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
        port, packed = struct.unpack_from("!2xH4s", raw)
        host = socket.inet_ntoa(packed)
        try:
            up_reader, up_writer = await asyncio.open_connection(host, port)
        except OSError as e:
            print(f"fault_proxy: cannot reach {host}:{port}: {e}", file=sys.stderr, flush=True)
            writer.transport.abort()
            return
        self.connections += 1
        self.sockets += [writer, up_writer]
        await asyncio.gather(self.pump(reader, up_writer), self.pump(up_reader, writer))


async def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("port", type=int)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    args = parser.parse_args()
    relay = Relay(args.delay_ms / 1000.0)
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, relay.stalled.set)
    loop.add_signal_handler(signal.SIGUSR2, relay.reset_all)
    loop.add_signal_handler(signal.SIGTERM, done.set)
    server = await asyncio.start_server(relay.handle, "0.0.0.0", args.port)
    print(f"fault_proxy: relaying on port {args.port}, delay {args.delay_ms} ms", flush=True)
    await done.wait()
    server.close()
    print(f"relayed {relay.connections} connections, {relay.bytes} bytes", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
