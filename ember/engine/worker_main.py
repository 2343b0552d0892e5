"""A tensor-parallel worker process (ember/engine/workers.py): rank r of the engine's devices.

It reads (config, rank, size, rendezvous, plan address, hello address, reports address, parent
pid) from its stdin, dies with
the engine core that started it, joins the process group, builds the engine's start-up for its
rank, and runs every step plan rank 0 sends until told to stop. A decode engine's worker also
reads its heads of a prompt's KV when rank 0 says (`LoadKV`), and reports how that went; with a
host tier it repeats rank 0's copies between its cache and host memory (`TierCopy`, `TierFence`,
`TierPace`), and with a disk or store tier rank 0's writes and reads in its own (`TierLower`,
`TierTouch`; ember/kv/tiers/replica.py)."""

from __future__ import annotations

import faulthandler
import logging
import os
import pickle
import signal
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import zmq

    from ember.engine.kv_connector import ShardReader
    from ember.engine.step_plan import LoadKV, TagKV, TierLower, TierMessage, TierTouch
    from ember.kv.tiers.replica import HostReplica, LowerReplica


def main() -> None:
    config, rank, size, init_method, address, hello, reports, acks, parent = pickle.load(
        sys.stdin.buffer
    )
    from ember.parent_death import die_with_parent

    die_with_parent(parent, signal.SIGKILL)  # no worker outlives its engine core
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when we stop
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID`: where a hung worker is
    logging.basicConfig(
        level=os.environ.get("EMBER_LOG_LEVEL", "INFO"),
        format=f"%(levelname)s:rank {rank}:%(name)s:%(message)s",
    )
    import torch
    import zmq

    from ember.distributed import state
    from ember.engine.core import EngineCore
    from ember.engine.expert_load import ExpertLoadMeter
    from ember.engine.kv_tiers import build_lower_replica, model_fingerprint
    from ember.engine.step_plan import (
        LoadKV,
        StopWorkers,
        TagKV,
        TierCopy,
        TierFence,
        TierLower,
        TierPace,
        TierTouch,
        decode,
    )

    if config.device == "cpu":
        torch.set_num_threads(config.cpu_threads or 1)
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    ctx = zmq.Context()
    plans = ctx.socket(zmq.PULL)
    plans.connect(address)
    joining = ctx.socket(zmq.PUSH)
    joining.connect(hello)
    joining.send(str(rank).encode())  # rank 0 waits for this, not a rendezvous, while we start
    joining.close(linger=1000)
    state.init(
        rank,
        size,
        init_method,
        device,
        config.enable_expert_parallel,
        config.enable_dp_attention,
    )
    core = EngineCore(config)
    runner = core.runner
    report = ctx.socket(zmq.PUSH)
    report.connect(reports)
    if config.kv_role == "prefill" and core.kv_reader is not None:
        # Where this rank's heads of the leased blocks are: rank 0 names them in its leases.
        reader = core.kv_reader
        report.send(f"region {rank} {reader.base_addr} {reader.transport.address}".encode())
    meter = ExpertLoadMeter(runner.model)
    lower = build_lower_replica(
        config,
        runner.kv_cache,
        model_fingerprint(config.model, config.load_format, device),
        core.replica,
        rank,
        _Acks(ctx, acks, rank),
    )
    reported = None
    # KV reads run on a thread beside the steps; their outcomes go out from this loop (a ZeroMQ
    # socket belongs to one thread).
    reads = ThreadPoolExecutor(2, "ember-kv-load")
    loading: dict[int, Future[int | None]] = {}
    try:
        while True:
            # Idle a second at most (the expert load's last figure still goes out); while KV
            # reads run, a few milliseconds, for rank 0 to hear of them soon.
            if plans.poll(5 if loading else 1000):
                msg = decode(plans.recv(copy=False).bytes)
                if isinstance(msg, StopWorkers):
                    break
                if isinstance(msg, LoadKV):
                    if msg.rank in (-1, rank):  # (another rank's request: not ours to read)
                        loading[msg.load_id] = reads.submit(_read_kv, core.kv_reader, msg)
                elif isinstance(msg, TagKV):
                    if msg.keys[rank]:
                        tags = _tag_kv(core.kv_reader, msg, rank)
                        report.send(f"tags {rank} {msg.tag_id} {','.join(tags)}".encode())
                elif isinstance(msg, TierCopy | TierFence | TierPace):
                    _tier(core.replica, msg)
                elif isinstance(msg, TierLower | TierTouch):
                    _lower(lower, msg)
                else:
                    runner.run(msg, None)
            for load_id in [i for i, f in loading.items() if f.done()]:
                nbytes = loading.pop(load_id).result()
                ok, nbytes = (0, 0) if nbytes is None else (1, nbytes)
                report.send(f"kv {rank} {load_id} {ok} {nbytes}".encode())
            load = meter.poll()
            if load is not None and load != reported:
                report.send(f"expert {rank} {load}".encode(), zmq.NOBLOCK)
                reported = load
    finally:
        if lower is not None:
            lower.close()  # the jobs queued so far first: their blocks on disk for a restart
        reads.shutdown(wait=True, cancel_futures=True)
        report.close(linger=0)
        plans.close(linger=0)
        ctx.term()
        core.close()
        state.close()


class _Acks:
    """How this rank's lower-tier thread answers rank 0 (`lower RANK JOB_ID COUNT`): on a socket of
    that thread's own, made at its first answer and closed by it at its end."""

    def __init__(self, ctx: zmq.Context, address: str, rank: int) -> None:
        self.ctx, self.address, self.rank = ctx, address, rank
        self.sock: zmq.Socket | None = None

    def __call__(self, job_id: int, count: int) -> None:
        import zmq

        if self.sock is None:
            self.sock = self.ctx.socket(zmq.PUSH)
            self.sock.setsockopt(zmq.LINGER, 1000)
            self.sock.connect(self.address)
        self.sock.send(f"lower {self.rank} {job_id} {count}".encode())

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def _tier(replica: HostReplica | None, msg: TierMessage) -> None:
    """Rank 0's host tier copy, fence or pace, on this rank's heads."""
    from ember.engine.step_plan import TierCopy, TierFence

    if replica is None:
        raise RuntimeError("rank 0 sent a KV tier copy, but this rank has no host tier")
    if isinstance(msg, TierCopy):
        replica.copy(msg.up, msg.slots, msg.gpu_ids)
    elif isinstance(msg, TierFence):
        replica.fence(msg.block_ids)
    else:
        replica.set_pace(msg.pace)  # type: ignore[arg-type]  # rank 0 sends a Pace


def _lower(lower: LowerReplica | None, msg: TierLower | TierTouch) -> None:
    """Rank 0's disk or store job, or a touch, for this rank's own tiers."""
    from ember.engine.step_plan import TierLower

    if lower is None:
        raise RuntimeError("rank 0 sent a disk or store job, but this rank has none")
    if isinstance(msg, TierLower):
        lower.submit(msg.job_id, msg.medium, msg.write, msg.keys, msg.slots)
    else:
        lower.touch(msg.medium, msg.keys)


def _tag_kv(reader: ShardReader | None, msg: TagKV, rank: int) -> list[str]:
    """This rank's tags of its share of a lease's blocks, under its key (over Mooncake)."""
    if reader is None or reader.tagger is None:
        return []  # rank 0's lease then fails every decode engine's check: nothing is trusted
    return reader.tagger.tags(msg.block_ids, msg.keys[rank])


def _read_kv(reader: ShardReader | None, load: LoadKV) -> int | None:
    """This rank's heads of a load's blocks, read into its cache: the bytes read, or None
    (logged) on any failure: rank 0 then prefills the prompt itself."""
    if reader is None:
        logging.getLogger(__name__).warning("a KV read, but this engine reads none (kv_role)")
        return None
    try:
        from ember.engine.kv_connector import TagCheck

        check = TagCheck(load.lease_id, load.rank_tags, load.first) if load.rank_tags else None
        return reader.read(
            load.peers,
            load.remote_bases,
            load.remote_block_bytes,
            load.remote_ids,
            load.local_ids,
            check,
        )
    except Exception as e:
        logging.getLogger(__name__).warning("KV read %d failed: %s", load.load_id, e)
        return None


if __name__ == "__main__":
    main()
