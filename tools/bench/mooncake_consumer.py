#!/usr/bin/env python3
"""Runs vLLM 0.33's own ECMooncakeConnector consumer (worker role, CPU receive slab, Mooncake's
TCP transport, loopback only) until interrupted, for `cargo bench -p iris-ec --features
test-consumer --bench push`:

    python3 tools/bench/mooncake_consumer.py --port 15500 --slab-gib 4 &
    IRIS_BENCH_VLLM_CONSUMER=tcp://127.0.0.1:15500 cargo bench -p iris-ec --features test-consumer --bench push

It accepts pushes into its slab exactly as a prefill/decode instance does; nothing loads them,
so the slab must hold every item a run pushes (a consumer keeps an unloaded push for 300 s).
Needs vLLM 0.33.0 (no GPU) and mooncake-transfer-engine-non-cuda (libibverbs loadable).
"""

import argparse
import os
import signal
import sys
import time
import types

os.environ["VLLM_HOST_IP"] = "127.0.0.1"
os.environ["MC_FORCE_TCP"] = "1"
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True, help="the control port (ec_port)")
    parser.add_argument("--slab-gib", type=float, default=4, help="receive slab size in GiB")
    args = parser.parse_args()

    import torch
    from vllm.config import ECTransferConfig
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.mooncake_ec_connector import (
        ECMooncakeConnector,
    )

    config = types.SimpleNamespace(
        ec_transfer_config=ECTransferConfig(
            ec_connector="ECMooncakeConnector",
            ec_role="ec_consumer",
            ec_buffer_device="cpu",
            ec_buffer_size=int(args.slab_gib * (1 << 30)),
            ec_ip="127.0.0.1",
            ec_port=args.port,
            ec_connector_extra_config={"mooncake_protocol": "tcp"},
        ),
        parallel_config=types.SimpleNamespace(
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            data_parallel_size=1,
            data_parallel_index=0,
        ),
        model_config=types.SimpleNamespace(dtype=torch.bfloat16),
    )
    worker = ECMooncakeConnector(config, ECConnectorRole.WORKER)
    worker.start_worker_services()
    print(f"consumer listening at tcp://127.0.0.1:{args.port}", flush=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        while not stop:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    worker.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
