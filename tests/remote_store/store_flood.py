"""A flood of malformed traffic against a store, run as its own process by test_remote_flood.py:

    python store_flood.py KIND URL MAX_SECONDS

It prints `reached` once it has sent its kind's TARGET (enough to take an unguarded store past
the memory bound), floods on (up to three times the target) until SIGTERM or MAX_SECONDS,
resets every connection it holds, and prints one JSON line: connections opened, how many the
store hung up on, bytes sent. Kinds:
- garbage: random frames, single and multipart, over one connection at a time
- wrong_sizes: plausible put headers whose block frames (up to 1 MiB) are not the declared size
- big_frames: one multipart message that never ends, of frames just under the 64 MiB limit
- truncated: a put header, then a 64 MiB frame cut short; up to 32 connections hold theirs
- half_sent: a put of 8 blocks of 8 MiB without its last frame; every other connection resets
  at once, the rest hold theirs (32 at most)
"""

from __future__ import annotations

import json
import random
import signal
import sys
import time

from store_peers import ZmtpPeer

from transfer.keys import Namespace
from transfer.remote.store.protocol import Op, encode_request

MiB = 1 << 20
BIG = 64 * MiB - 4096  # a frame just under the store's default frame limit
HOLDERS = 32
GiB = 1 << 30
TARGET = {"garbage": ("messages", 200), "wrong_sizes": ("messages", 100),
          "big_frames": ("sent", 3 * GiB // 2), "truncated": ("opened", HOLDERS),
          "half_sent": ("opened", 2 * HOLDERS)}
NS = Namespace("flood", "bfloat16", 16, "BLNHC")
KEYS = NS.keys([b"flood-%d" % i for i in range(8)])
ZEROS = memoryview(bytes(BIG))


class Flood:
    def __init__(self, url: str, kind: str, seed: int) -> None:
        self.url, self.rng = url, random.Random(seed)
        self.opened = self.hung_up = self.sent = self.messages = 0
        self.stopped = self.reached = False
        self.held: list[ZmtpPeer] = []
        self._target = TARGET[kind]

    def progress(self) -> None:
        """Say `reached` at the target; past three times the target, idle (a store that
        never drops the flood must not take the machine's memory)."""
        counter, target = self._target
        if not self.reached and getattr(self, counter) >= target:
            self.reached = True
            print("reached", flush=True)
        while getattr(self, counter) >= 3 * target and not self.stopped:
            time.sleep(0.05)

    def connect(self) -> ZmtpPeer:
        self.opened += 1
        return ZmtpPeer(self.url)

    def lost(self, peer: ZmtpPeer) -> None:
        self.hung_up += 1
        peer.abort()

    def put_header(self, sizes: list[int]) -> bytes:
        keys = KEYS[:len(sizes)]
        return encode_request(self.rng.getrandbits(32), Op.PUT, NS.digest, keys, sizes,
                              [self.rng.getrandbits(64) for _ in keys])

    def send_messages(self, make: callable) -> None:
        """Messages from `make` over one connection; a new one when the store hangs up."""
        peer = self.connect()
        while not self.stopped:
            frames = make()
            try:
                peer.send_message(frames)
            except OSError:
                self.lost(peer)
                peer = self.connect()
            self.sent += sum(len(f) for f in frames)
            self.messages += 1
            self.progress()
        # A store kept off the CPU may read (and drop) this peer only once all its messages are
        # sent and it idles past three times its target: look for that hang-up before leaving.
        if peer.hung_up(0.0 if self.hung_up else 10.0):
            self.lost(peer)
        else:
            peer.abort()

    def garbage(self) -> None:
        rng = self.rng
        self.send_messages(lambda: [rng.randbytes(rng.randint(0, 300))
                               for _ in range(rng.randint(1, 4))])

    def wrong_sizes(self) -> None:
        rng = self.rng
        self.send_messages(lambda: [self.put_header([rng.randint(1, MiB) for _ in range(4)]),
                               *(ZEROS[:rng.randint(1, MiB)] for _ in range(4))])

    def big_frames(self) -> None:
        peer = self.connect()
        peer.send_frame(self.put_header([4096]), more=True)
        while not self.stopped:
            try:
                peer.send_frame(ZEROS, more=True)
                self.sent += BIG
                self.progress()
            except OSError:
                self.lost(peer)
                peer = self.connect()
                peer.send_frame(self.put_header([4096]), more=True)
        peer.abort()

    def hold(self, start: callable) -> None:
        """Keep HOLDERS connections each holding what `start` sent; replace those dropped."""
        while not self.stopped:
            for peer in [p for p in self.held if p.hung_up(0.001)]:
                self.held.remove(peer)
                self.lost(peer)
            self.progress()
            if len(self.held) >= HOLDERS:
                time.sleep(0.01)
                continue
            peer = self.connect()
            try:
                if start(peer):
                    self.held.append(peer)
                else:
                    peer.abort()  # abruptly, mid-message
            except OSError:
                self.lost(peer)

    def truncated(self) -> None:
        def start(peer: ZmtpPeer) -> bool:
            peer.send_frame(self.put_header([BIG]), more=True)
            peer.send_frame_head(BIG, more=False)
            cut = BIG - self.rng.randint(1, 8 * MiB)
            peer.send_raw(ZEROS[:cut])
            self.sent += cut
            return True

        self.hold(start)

    def half_sent(self) -> None:
        def start(peer: ZmtpPeer) -> bool:
            peer.send_frame(self.put_header([8 * MiB] * 8), more=True)
            for _ in range(7):
                peer.send_frame(ZEROS[:8 * MiB], more=True)
            self.sent += 56 * MiB
            return self.opened % 2 == 0

        self.hold(start)


def main() -> None:
    kind, url, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    flood = Flood(url, kind, seed=24)

    def stop(*_: object) -> None:
        flood.stopped = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    getattr(flood, kind)()
    for peer in flood.held:
        peer.abort()
    print(json.dumps({"kind": kind, "opened": flood.opened, "hung_up": flood.hung_up,
                      "sent": flood.sent}), flush=True)


if __name__ == "__main__":
    main()
