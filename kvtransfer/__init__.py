"""Moving paged KV blocks between workers over torch.distributed (knows blocks, not requests).

A decode worker runs a :class:`KvReceiver` (rendezvous store + one 2-rank group per sender);
a prefill worker runs a :class:`KvSender`. See ``kvtransfer.receiver`` and
``kvtransfer.sender`` for the contracts.
"""

from kvtransfer.blockcopy import Copier, KvShards
from kvtransfer.config import ReceiverOptions, SenderOptions
from kvtransfer.expectations import TransferHandle
from kvtransfer.layout import KvLayout
from kvtransfer.ready import LayerReady, LayerReadyError
from kvtransfer.receiver import KvReceiver
from kvtransfer.results import TransferCounters, TransferError, TransferResult, TransferStats
from kvtransfer.sender import KvSender

__all__ = [
    "Copier",
    "KvLayout",
    "KvReceiver",
    "KvSender",
    "KvShards",
    "LayerReady",
    "LayerReadyError",
    "ReceiverOptions",
    "SenderOptions",
    "TransferCounters",
    "TransferError",
    "TransferHandle",
    "TransferResult",
    "TransferStats",
]
