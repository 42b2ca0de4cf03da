"""The device policy's prefetch copies on the copy engine: a host thread issues them from the lists the token's
graph writes, one layer ahead (`EngineConfig.prefetch_copies="copy_engine"`; `DevicePolicy`).

The copy kernel (`kernels.expert_copy`) moves experts with SMs and needs no host; the copy engine moves them
faster beside the token's compute (BENCHMARKS.md, "The copy kernel against the copy engine": 54.7 against 36.0
GB/s beside a GEMM) but only a host call can start it. Prefetches are known a layer before they are needed (part
1 of layer l + 1 runs beside the route, MoE and attention of l), so a host thread has that long to issue them:

- at the token's start the graph copies the token's number `seq` from a pinned host word to the device;
- after part 1 of layer l + 1 (on the side branch) the graph copies the prefetch list (int64 [1 + 2N]: count,
  experts, slots) into row l + 1 of a pinned mailbox, then `seq` into the mailbox's word for l + 1 (a second copy,
  ordered after the first on its stream, so the host sees the number only once the list is there);
- the host thread polls the mailbox layer by layer for this token's number, issues the listed copies on the
  residency's copy stream (`CopyStream.copy_raw`: cuda-python's batched call where installed), then, on the copy
  stream after them, writes `seq` into the layer's flag in device memory;
- before layer l + 1's route the graph holds the compute stream in `expert_copy.await_copies` until the flag
  holds `seq`, where the list's count is not 0 (as the kernel path joins the side branch there).

Decisions never depend on any of this: the device cache decides, the copies only fill the slots it chose before
the MoE reads them. A thread that fails or never answers makes the token's wait give up after a few seconds
(`AWAIT_LIMIT` polls): `end` raises the thread's error, or says the wait timed out. On the CPU (Triton's
interpreter, tests) the graph is a function run in order, so `post` issues the copies itself, at once (no thread,
no wait): the same mailbox and copy calls, in line.
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from specmoe.kernels.expert_copy import await_copies

POLL_TIMEOUT_S = 10.0  # the host thread's wait for one layer's list before it gives up


class PrefetchIssuer:
    """The mailbox, flags and host thread of one `DevicePolicy` (module docstring). `post` and `hold` are called
    inside the token's body (captured into its graph); `begin` before a launch, `end` after it."""

    def __init__(self, copies, num_layers: int, max_listed: int, device, cuda: bool):
        self.copies, self.cuda = copies, cuda
        self.max_listed = max_listed
        pin = cuda
        self.seq_host = torch.zeros(1, dtype=torch.int64, pin_memory=pin)
        self.seq_dev = torch.zeros(1, dtype=torch.int64, device=device)
        self.mail = torch.zeros(num_layers, 1 + 2 * max_listed, dtype=torch.int64, pin_memory=pin)
        self.mail_seq = torch.full((num_layers,), -1, dtype=torch.int64, pin_memory=pin)
        self.mail_np, self.mail_seq_np = self.mail.numpy(), self.mail_seq.numpy()
        self.flags = torch.full((num_layers,), -1, dtype=torch.int64, device=device)
        self.status = torch.zeros(1, dtype=torch.int32, device=device)
        self.seq = 0
        self.layers: list[int] = []  # the layers whose lists the current token posts, in order
        self.delays = None
        self._jobs: queue.Queue = queue.Queue()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    # -- inside the token's body -----------------------------------------------------------------------
    def start_token(self) -> None:
        """The token's number onto the device (the body's first operation)."""
        self.seq_dev.copy_(self.seq_host, non_blocking=True)

    def post(self, layer: int, listing: torch.Tensor) -> None:
        """After part 1 of `layer`: its prefetch list to the mailbox, then the token's number (CPU: the copies,
        at once)."""
        self.mail[layer].copy_(listing, non_blocking=True)
        self.mail_seq[layer:layer + 1].copy_(self.seq_dev, non_blocking=True)
        if not self.cuda:
            self._issue(layer, int(self.seq_host[0]))

    def hold(self, layer: int, listing: torch.Tensor) -> None:
        """Before `layer`'s route: wait on the device until its listed prefetches have landed."""
        if self.cuda:
            await_copies(listing, self.flags[layer:layer + 1], self.seq_dev, self.status)

    # -- around a launch (host) ----------------------------------------------------------------------------
    def begin(self, layers: list[int], delays) -> None:
        """Before a launch whose body posts the lists of `layers`: a new token number. delays:
        `device_policy.copy_delays` (the prefetch of layer l waits delays[2l - 1])."""
        self.seq += 1
        self.seq_host[0] = self.seq
        self.layers, self.delays = layers, delays
        self._done.clear()

    def go(self) -> None:
        """Once the launch is out (CUDA): the host thread starts issuing this token's lists. After the launch, not
        before: the thread polls, and the launching thread should not wait for the GIL meanwhile."""
        if not self.cuda:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="specmoe-prefetch", daemon=True)
            self._thread.start()
        self._jobs.put(self.seq)

    def end(self, gave_up: bool) -> None:
        """After the launch has completed: wait for the host thread's token, then raise what went wrong (its
        error, or a device wait that gave up: `status`, which the caller copied out with the token's records)."""
        if not self.cuda:
            return
        self._done.wait()
        error, self._error = self._error, None
        if gave_up:
            self.status.zero_()
        if error is not None:
            raise RuntimeError(f"the prefetch copies' host thread failed: {error!r}") from error
        if gave_up:
            raise RuntimeError("a layer's wait for its copy-engine prefetches gave up: the host thread did not "
                               "answer (kernels.expert_copy.AWAIT_LIMIT)")

    def close(self) -> None:
        """Stop the host thread (it is a daemon; an engine that is dropped need not call this)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    # -- the host thread -------------------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            seq = self._jobs.get()
            if seq is None:
                return
            try:
                with torch.cuda.device(self.flags.device):
                    for layer in self.layers:
                        self._wait_mail(layer, seq)
                        self._issue(layer, seq)
            except BaseException as exc:  # reported by `end`; the device's wait gives up on its own
                self._error = exc
            finally:
                self._done.set()

    def _wait_mail(self, layer: int, seq: int) -> None:
        words = self.mail_seq_np
        if words[layer] == seq:
            return
        give_up = time.perf_counter() + POLL_TIMEOUT_S
        while words[layer] != seq:
            time.sleep(0)  # lets a thread that needs the GIL have it (e.g. an eager body still launching)
            if time.perf_counter() > give_up:
                raise TimeoutError(f"no prefetch list of layer {layer} for token {seq} within {POLL_TIMEOUT_S} s")

    def _issue(self, layer: int, seq: int) -> None:
        """The copies of the mailbox's list of `layer`, then (CUDA) `seq` into the layer's flag after them."""
        row, n = self.mail_np[layer], int(self.mail_np[layer, 0])
        if n == 0:
            return
        experts = row[1:1 + n].tolist()
        slots = row[1 + self.max_listed:1 + self.max_listed + n].tolist()
        delay = None if self.delays is None else int(self.delays[2 * layer - 1])
        self.copies.copy_raw(layer, slots, experts, delay)
        if self.cuda:
            with torch.cuda.stream(self.copies.stream):
                self.flags[layer].fill_(seq)


def listed_layers(num_layers: int, inserts: bool) -> list[int]:
    """The layers whose prefetch lists a token posts: 1 .. L - 1 where the policy inserts (part 1 of layer 0 never
    runs on a token's path), none otherwise."""
    return list(range(1, num_layers)) if inserts else []

