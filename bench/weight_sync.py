"""Seconds to publish a weight version, per weight_sync mode, next to a raw memory copy.

    python bench/weight_sync.py [--sizes 10M,100M,500M] [--dtype bfloat16] [--repeats 2]

For Qwen2-architecture models of about 10M, 100M and 500M parameters (random init, built
here, nothing downloaded), "publish" is measured the way the system does it, from the
trainer holding new weights to a rollout-worker process holding the complete new weight set
in its memory (loading it into an engine is not included; that cost is the same for every
mode). Sender and receiver are separate processes on this machine:

- memcpy:      one copy of the same bytes in one process (`dst.copy_(src)`): the physical
               reference, what moving the bytes once through memory costs here.
- disk:        trainer: publish_to_disk (safetensors, temp file + fsync + rename);
               receiver: load_tensors from the page cache (a shared file system adds its
               own bandwidth on a cluster).
- stream:      trainer: stream_chunks (CPU bucket copies) -> ZeroMQ DEALER -> the relay
               (a ROUTER, as the controller) -> receiver DEALER; decoded without copies.
- stream+curve the same over CurveZMQ (encrypted), as with remote workers.
- collective:  trainer: collective_snapshot (flat CPU buckets) -> gloo broadcast in a
               weights group of 2 (trainer rank 0 + one rollout worker) -> unflattened views.
- shm:         trainer: ShmPublisher (one copy into a shared-memory slot it has mapped since
               its first publication) -> the slot's path -> receiver: SlotReader views of the
               mapped slot under its lock (no copy). Steady state: the third version, after
               both slots were written once and mapped by both sides, as in a run's every
               later step.
- shm-first:   the same, the very first publication: the slots' memory is allocated and
               mapped then (once per run), and the receiver maps the slot.

Every mode runs `--repeats` times; the best time is reported (the machine is shared).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_page import publish, write_results

MODELS = {  # name: (hidden, layers, intermediate, vocab, heads, kv heads)
    "10M": (256, 6, 1024, 16384, 4, 2),
    "100M": (768, 10, 2560, 32000, 12, 4),
    "500M": (1280, 22, 4480, 32000, 20, 4),
}
MODES = ("disk", "stream", "stream+curve", "collective", "shm", "shm-first")
SHM_VERSIONS = 3
"""shm: versions published per measurement; the last is timed (the first for shm-first)."""


def build_model(name: str, dtype: torch.dtype) -> torch.nn.Module:
    """The Qwen2 model of size `name` (a key of MODELS), randomly initialised."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, layers, inter, vocab, heads, kv = MODELS[name]
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).to(dtype)


def lora_rank(name: str) -> int:
    """'500M+lora16' -> 16 (the adapters of that model are published); '500M' -> 0."""
    return int(name.partition("+lora")[2] or 0)


def build_tensors(name: str, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """What the trainer publishes for `name`: the model's weights, or for '<size>+lora<r>'
    its LoRA adapters of rank r (areal.models.lora, the default target modules)."""
    from areal.config import LoraConfig
    from areal.models.lora import add_adapters, adapter_tensors
    from areal.models.weights import named_tensors

    model = build_model(name.partition("+lora")[0], dtype)
    rank = lora_rank(name)
    if rank:
        model = add_adapters(model, LoraConfig(rank=rank), seed=0)
        return [(n, t.contiguous()) for n, t in adapter_tensors(model)]
    return [(n, t.contiguous()) for n, t in named_tensors(model)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _config(run_dir: str, mode: str = "disk", model: str = ""):
    from areal.config import load_config

    shm = mode.startswith("shm")
    return load_config(
        overrides=[
            f"run_dir={run_dir}",
            "weight_sync.bucket_mb=64",
            f"weight_sync.keep_versions={2 if shm else 1}",
            f"weight_sync.mode={'shm' if shm else 'disk'}",
            f"trainer.lora.rank={lora_rank(model)}",
        ]
    )


# -- the trainer side (one process per measurement) -----------------------------------------------


def _sender(
    _: int, mode: str, model: str, dtype: str, run_dir: str, address: str, keys: str, start_queue
) -> None:
    torch.set_num_threads(1)
    tensors = build_tensors(model, getattr(torch, dtype))
    cfg = _config(run_dir, mode, model)
    if mode == "disk":
        from areal.workers.trainer.publish import publish_to_disk

        start_queue.put(time.time())
        start_queue.put(publish_to_disk(tensors, cfg, 1))
    elif mode.startswith("stream"):
        asyncio.run(
            _stream_send(tensors, cfg, address, keys if mode.endswith("curve") else "", start_queue)
        )
    else:
        from areal.workers.collective import WeightsGroup, host_store
        from areal.workers.trainer.publish import collective_snapshot

        store, _ = host_store("127.0.0.1", int(address), timeout_s=120)
        group = WeightsGroup()
        group.join(store=store, generation=1, rank=0, world_size=2, backend="gloo", timeout_s=120)
        start_queue.put(time.time())
        snapshot = collective_snapshot(tensors, cfg, 1)
        start_queue.put(snapshot.manifest)
        group.send(snapshot, 1)
        time.sleep(1)  # the receiver confirms through the parent


async def _stream_send(tensors, cfg, address: str, keys: str, start_queue) -> None:
    import zmq.asyncio

    from areal.auth import load_client_keys
    from areal.transport import DealerChannel
    from areal.workers.trainer.publish import stream_chunks

    ctx = zmq.asyncio.Context()
    channel = DealerChannel(
        ctx, address, b"trainer", curve=load_client_keys(keys) if keys else None
    )
    await channel.socket.send(b"hello")  # let the relay learn this identity
    await channel.socket.recv()
    start_queue.put(time.time())
    for chunk in stream_chunks(tensors, cfg, 1):
        await channel.send(chunk)
    await channel.socket.recv()  # the relay says the receiver has everything
    channel.close()
    ctx.term()


def _shm_sender(
    _: int, mode: str, model: str, dtype: str, run_dir: str, to_receiver, acks, start_queue
) -> None:
    from areal.workers.trainer.publish import ShmPublisher

    torch.set_num_threads(1)
    tensors = build_tensors(model, getattr(torch, dtype))
    publisher = ShmPublisher(_config(run_dir, "shm", model))
    timed = 1 if mode == "shm-first" else SHM_VERSIONS
    for version in range(1, timed + 1):
        if version == timed:
            start_queue.put(time.time())
        to_receiver.put((publisher.publish(tensors, version).weights_path, version))
        acks.get()  # the receiver has read it
    publisher.close(finished=True)


# -- the rollout side -----------------------------------------------------------------------------


def _shm_receiver(_: int, num_versions: int, to_receiver, acks, done_queue) -> None:
    from areal.models.weight_slots import SlotReader

    torch.set_num_threads(1)
    reader = SlotReader()
    for _ in range(num_versions):
        path, version = to_receiver.get()
        with reader.read(path, version) as views:  # the whole weight set, in place
            end = time.time()
            num_bytes = sum(t.numel() * t.element_size() for _, t in views)
        acks.put(None)
    done_queue.put((end, num_bytes))
    reader.close()


def _receiver(_: int, mode: str, address: str, keys: str, info_queue, done_queue) -> None:
    torch.set_num_threads(1)
    if mode == "disk":
        from areal.models.weights import load_tensors

        path = info_queue.get()
        tensors = load_tensors(path)
    elif mode.startswith("stream"):
        tensors = asyncio.run(_stream_receive(address, keys if mode.endswith("curve") else ""))
    else:
        from areal.workers.collective import WeightsGroup

        group = WeightsGroup()
        group.join(
            store=f"127.0.0.1:{address}",
            generation=1,
            rank=1,
            world_size=2,
            backend="gloo",
            timeout_s=120,
        )
        manifest = info_queue.get()
        tensors = group.receive(manifest, 1)
    done_queue.put((time.time(), sum(t.numel() * t.element_size() for t in tensors.values())))


async def _stream_receive(address: str, keys: str) -> dict[str, torch.Tensor]:
    import zmq.asyncio

    from areal.auth import load_client_keys
    from areal.messages import WeightsChunk
    from areal.transport import DealerChannel

    ctx = zmq.asyncio.Context()
    channel = DealerChannel(
        ctx, address, b"rollout", curve=load_client_keys(keys) if keys else None
    )
    await channel.socket.send(b"hello")
    tensors: dict[str, torch.Tensor] = {}
    while True:
        chunk = await channel.recv()
        assert isinstance(chunk, WeightsChunk)
        tensors.update(zip(chunk.names, chunk.tensors, strict=True))
        if chunk.index == chunk.num_chunks - 1:
            break
    await channel.socket.send(b"done")
    channel.close(0)
    ctx.term()
    return tensors


async def _relay(port: int, keys: str, ready) -> None:
    """The controller's part in stream mode: relay every chunk to the rollout worker."""
    import zmq.asyncio

    from areal.auth import load_server_keys
    from areal.codec import decode
    from areal.transport import RouterChannel

    ctx = zmq.asyncio.Context()
    zap = None
    server_keys = load_server_keys(keys) if keys else None
    if server_keys is not None:
        from areal.auth import ZapHandler

        zap = ZapHandler(ctx, server_keys)
        zap_task = asyncio.create_task(zap.serve())
    channel = RouterChannel(ctx, "127.0.0.1", port, curve=server_keys)
    ready.set()
    peers = {}
    while len(peers) < 2:
        identity, hello = await channel.socket.recv_multipart()
        peers[identity] = hello
    await channel.socket.send_multipart([b"trainer", b"go"])
    while True:
        frames = await channel.socket.recv_multipart(copy=False)
        if frames[0].bytes == b"rollout":  # "done"
            await channel.socket.send_multipart([b"trainer", b"done"])
            break
        await channel.send(b"rollout", decode(frames[1:]))
    channel.close()
    if zap is not None:
        zap_task.cancel()
        await asyncio.gather(zap_task, return_exceptions=True)
    ctx.term()


def measure_shm(mode: str, model: str, dtype: str) -> tuple[float, int]:
    """(seconds, bytes) of the timed publication of a shm measurement (see the docstring)."""
    ctx = mp.get_context("spawn")
    run_dir = tempfile.mkdtemp(prefix="areal-bench-")
    to_receiver, acks, done_queue, start_queue = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    num_versions = 1 if mode == "shm-first" else SHM_VERSIONS
    receiver = ctx.Process(
        target=_shm_receiver, args=(0, num_versions, to_receiver, acks, done_queue)
    )
    sender = ctx.Process(
        target=_shm_sender, args=(0, mode, model, dtype, run_dir, to_receiver, acks, start_queue)
    )
    receiver.start()
    sender.start()
    start = start_queue.get()
    end, num_bytes = done_queue.get()
    for proc in (sender, receiver):
        proc.join()
    return end - start, num_bytes


def measure(mode: str, model: str, dtype: str, keys: str) -> tuple[float, int]:
    """(seconds, bytes) of one publication in `mode`."""
    if mode.startswith("shm"):
        return measure_shm(mode, model, dtype)
    ctx = mp.get_context("spawn")
    run_dir = tempfile.mkdtemp(prefix="areal-bench-")
    port = _free_port()
    info_queue, done_queue, start_queue = ctx.Queue(), ctx.Queue(), ctx.Queue()
    address = f"tcp://127.0.0.1:{port}" if mode.startswith("stream") else str(port)
    relay = None
    if mode.startswith("stream"):
        import threading

        ready = threading.Event()
        relay = threading.Thread(
            target=lambda: asyncio.run(_relay(port, keys if mode.endswith("curve") else "", ready)),
            daemon=True,
        )
        relay.start()
        ready.wait()
    receiver = ctx.Process(target=_receiver, args=(0, mode, address, keys, info_queue, done_queue))
    sender = ctx.Process(
        target=_sender, args=(0, mode, model, dtype, run_dir, address, keys, start_queue)
    )
    receiver.start()
    sender.start()
    start = start_queue.get()
    if mode in ("disk", "collective"):
        info_queue.put(start_queue.get())  # the path / manifest, known once published
    end, num_bytes = done_queue.get()
    for proc in (sender, receiver):
        proc.join()
    if relay is not None:
        relay.join(10)
    return end - start, num_bytes


def memcpy_seconds(num_bytes: int, repeats: int) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(MODELS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    keys = tempfile.mkdtemp(prefix="areal-bench-keys-")
    from areal.auth import init_keys

    init_keys(keys)
    modes = args.modes.split(",")
    header = f"{'model':>6} {'params':>8} {'MB':>7} {'memcpy':>8} " + " ".join(
        f"{m:>20}" for m in modes
    )
    rows, data = [], []
    for size in args.sizes.split(","):
        params = sum(t.numel() for _, t in build_tensors(size, getattr(torch, args.dtype)))
        results, num_bytes = {}, 0
        for mode in modes:
            best = float("inf")
            for _ in range(args.repeats):
                seconds, num_bytes = measure(mode, size, args.dtype, keys)
                best = min(best, seconds)
            results[mode] = best
            print(f"  {size} {mode}: {best:.3f} s", file=sys.stderr, flush=True)
        copy = memcpy_seconds(num_bytes, args.repeats)
        rows.append(
            f"{size:>6} {params / 1e6:>7.1f}M {num_bytes / 2**20:>7.0f} {copy:>7.3f}s "
            + " ".join(f"{results[m]:>10.3f}s ({results[m] / copy:>5.1f}x)" for m in modes)
        )
        data.append(
            {
                "model": size,
                "params": params,
                "bytes": num_bytes,
                "memcpy_s": copy,
                "seconds": results,
                "ratio_to_memcpy": {m: results[m] / copy for m in modes},
            }
        )
    title = (
        f"seconds to publish one weight version ({args.dtype}, sender and receiver "
        f"processes on one machine, {os.cpu_count()} CPUs; best of {args.repeats}; in "
        "parentheses: time / memcpy of the same bytes)"
    )
    table = "\n".join([title, header, *rows])
    print(table)
    defaults = parser.parse_args([])
    full = (args.sizes, args.modes) == (defaults.sizes, defaults.modes)
    if publish(quick=not full):
        page = write_results(
            "weight_sync",
            title="Weight publication per weight_sync mode",
            command="python " + " ".join(sys.argv),
            table=table,
            data={"dtype": args.dtype, "repeats": args.repeats, "rows": data},
            notes=NOTES,
        )
        print(f"results page: {page}")
    return 0


NOTES = """\
Each cell is the time from the trainer holding a new version to a rollout-worker process
holding all of it (loading into an engine is not included: the same for every mode), with
the ratio to one memory copy of the same bytes on this machine. `shm` is the steady state
(every version after the first two: both slots allocated and mapped on both sides);
`shm-first` is the first publication of a run, which allocates the slots. The receiver
of `shm` holds views of the mapped slot (zero copy); the engine's own copy into its
parameters comes after, as for every mode.
"""


if __name__ == "__main__":
    sys.exit(main())
