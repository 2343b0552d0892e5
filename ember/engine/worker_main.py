"""A tensor-parallel worker process (ember/engine/workers.py): rank r of the engine's devices.

It reads (config, rank, size, rendezvous, plan address, parent pid) from its stdin, dies with
the engine core that started it, joins the process group, builds the engine's start-up for its
rank, and runs every step plan rank 0 sends until told to stop."""

from __future__ import annotations

import faulthandler
import logging
import os
import pickle
import signal
import sys


def main() -> None:
    config, rank, size, init_method, address, hello, reports, parent = pickle.load(sys.stdin.buffer)
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
    from ember.engine.step_plan import StopWorkers, decode

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
    state.init(rank, size, init_method, device, config.enable_expert_parallel)
    core = EngineCore(config)
    runner = core.runner
    report = ctx.socket(zmq.PUSH)
    report.connect(reports)
    meter = ExpertLoadMeter(runner.model)
    reported = None
    try:
        while True:
            # Idle a second at most: the expert load's last figure still goes out.
            if plans.poll(1000):
                msg = decode(plans.recv(copy=False).bytes)
                if isinstance(msg, StopWorkers):
                    break
                runner.run(msg, None)
            load = meter.poll()
            if load is not None and load != reported:
                report.send(f"{rank} {load}".encode(), zmq.NOBLOCK)
                reported = load
    finally:
        report.close(linger=0)
        plans.close(linger=0)
        ctx.term()
        core.close()
        state.close()


if __name__ == "__main__":
    main()
