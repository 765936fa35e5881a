"""The `rtxmpi` command.

    rtxmpi info                       environment of one process
    mpiexec -n 4 rtxmpi info          ... and of every rank: hosts, local ranks, devices
"""
import argparse
import platform
import socket
import sys

import numpy as np


def _versions():
    import h5py
    import mpi4py
    from mpi4py import MPI

    import rtxmpi

    try:
        import cupy

        cupy_version = cupy.__version__
    except Exception:
        cupy_version = "not installed"
    library = MPI.Get_library_version().strip().splitlines()[0].split(",")[0]
    return {
        "rtxmpi": rtxmpi.__version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "mpi4py": mpi4py.__version__,
        "h5py": h5py.__version__,
        "cupy": cupy_version,
        "MPI library": library,
        "MPI standard": "%d.%d" % MPI.Get_version(),
    }


_THREAD_LEVELS = {"THREAD_SINGLE": "single", "THREAD_FUNNELED": "funneled",
                  "THREAD_SERIALIZED": "serialized", "THREAD_MULTIPLE": "multiple"}


def _thread_level():
    from mpi4py import MPI

    level = MPI.Query_thread()
    for name, label in _THREAD_LEVELS.items():
        if getattr(MPI, name) == level:
            return label
    return str(level)


def cmd_info(args):
    """Print versions, the MPI library and thread level, world size, hosts, local ranks, GPUs."""
    from mpi4py import MPI

    from .backend import gpu_count
    from .comm import init
    from .errors import ConfigError

    warning = None
    try:
        group = init(timeout_s=args.timeout_s)
        rank, size, local_rank, device = group.rank, group.world_size, group.local_rank, group.device
    except ConfigError as exc:  # e.g. Slurm singletons: still describe this process
        warning = str(exc)
        comm = MPI.COMM_WORLD
        rank, size, local_rank, device = comm.Get_rank(), comm.Get_size(), 0, "cpu"
    row = (rank, socket.gethostname(), local_rank, device, gpu_count())
    rows = MPI.COMM_WORLD.gather(row, root=0) if size > 1 and warning is None else [row]
    if rank != 0:
        return 0
    for key, value in _versions().items():
        print(f"{key:<14} {value}")
    print(f"{'thread level':<14} {_thread_level()}")
    print(f"{'world_size':<14} {size}")
    hosts = sorted({r[1] for r in rows})
    print(f"{'hosts':<14} {len(hosts)}: {', '.join(hosts)}")
    gpus = rows[0][4]
    print(f"{'GPUs':<14} {gpus if gpus else 'none'} (on rank 0's host)")
    print(f"{'rank':>6} {'host':<24} {'local_rank':>10} {'device':<8}")
    for rank_, host, local, dev, _ in rows:
        print(f"{rank_:>6} {host:<24} {local:>10} {dev:<8}")
    if warning:
        print(f"warning: {warning}")
    return 0


def build_parser():
    parser = argparse.ArgumentParser(prog="rtxmpi", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, MPI library, world size, hosts, GPUs")
    info.add_argument("--timeout-s", type=float, default=60.0, dest="timeout_s",
                      help="deadline of the rank exchange (seconds)")
    info.set_defaults(func=cmd_info)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
