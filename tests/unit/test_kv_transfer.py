"""The KvTransfer service over real gRPC (executor/kv_transfer.py): a push lands byte for
byte and as the session's pins; every refusal names its cause with a status code and leaves
the receiver's blocks as they were; mutual TLS and the shared secret guard it."""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from common.sampling_params import SamplingParams
from deploy.certs import CertificateAuthority
from engine.engine import Engine
from engine.faults import Faults
from engine.kv_move import engine_layout, idle_sessions, read_blocks
from executor.engine_gate import EngineGate
from executor.kv_sender import KvSender
from executor.kv_transfer import KvReceiver, KvTransferConfig, start_kv_server
from executor.metrics import ExecutorMetrics
from protos.kvgate.v1 import internal_pb2, internal_pb2_grpc
from tests.helpers import greedy, make_engine, run_to_completion, wait_for

PROMPT = [1, 403, 178, 261, 144, 230, 160, 297, 261, 125, 29, 450, 178, 471] * 4
SECRET = "kv-secret"


@pytest.fixture(scope="module")
def sender() -> Engine:
    """An engine holding one idle session of PROMPT and 7 output tokens."""
    engine = make_engine()
    engine.add_request("turn", PROMPT, greedy(8), session_id="chat", cache_salt="acme")
    run_to_completion(engine)
    return engine


class Receiver:
    """A receiving engine behind a KvTransfer server on a free port."""

    def __init__(
        self, engine: Engine, config: KvTransferConfig, taking_work=lambda: True, names=()
    ):
        self.engine = engine
        receiver = KvReceiver(
            engine, EngineGate(), ExecutorMetrics(), taking_work, config.secret, frozenset(names)
        )
        self.server, self.address = start_kv_server(config, receiver)

    def idle(self) -> bool:
        kv = self.engine.kv_cache
        return kv.num_free_blocks == kv.num_blocks and not kv.sessions


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    served = Receiver(make_engine(), KvTransferConfig(port=0, secret=SECRET))
    yield served
    served.server.stop(None)


def push(sender: Engine, address: str, **config) -> bool:
    [session] = idle_sessions(sender)
    faults = config.pop("faults", Faults())
    transfer = KvTransferConfig(**({"secret": SECRET, "timeout_s": 5.0} | config))
    kv_sender = KvSender(sender, transfer, ExecutorMetrics(), "executor-a", faults)
    try:
        return kv_sender.push(session, address, "acme")
    finally:
        kv_sender.close()


def test_a_pushed_session_lands_byte_for_byte_as_the_sessions_pins(sender, receiver):
    assert push(sender, receiver.address)
    [session] = idle_sessions(sender)
    [landed] = idle_sessions(receiver.engine)
    assert (landed.session_id, landed.cache_salt) == ("chat", "acme")
    assert landed.token_ids == session.token_ids
    sent = read_blocks(sender.runner.kv_caches, session.block_ids)
    assert read_blocks(receiver.engine.runner.kv_caches, landed.block_ids) == sent
    # its full blocks are in the prefix cache too (another request of the tenant finds them)
    full = len(session.token_ids) // 16 * 16
    probe = receiver.engine.kv_cache
    assert probe.num_cached_prefix_tokens(_request(session.token_ids + [5], "acme")) >= full


def _request(tokens: list[int], salt: str):
    from engine.request import Request

    return Request("probe", tokens, SamplingParams(max_tokens=1), 0, cache_salt=salt)


def raw_push(address: str, messages: list[internal_pb2.PushRequest], secret: str | None = SECRET):
    stub = internal_pb2_grpc.KvTransferStub(grpc.insecure_channel(address))
    metadata = (("authorization", f"Bearer {secret}"),) if secret else ()
    with pytest.raises(grpc.RpcError) as raised:
        stub.Push(iter(messages), timeout=5.0, metadata=metadata)
    return raised.value


def header_of(engine: Engine, **changes) -> internal_pb2.KvHeader:
    layout = engine_layout(engine)
    [session] = idle_sessions(engine)
    fields = dict(
        executor_id="executor-a", model_id=layout.model_id, block_size=layout.block_size,
        kv_cache_dtype=layout.kv_cache_dtype, num_layers=layout.num_layers,
        token_bytes=layout.token_bytes, tenant="acme", session_id="chat",
        token_ids=session.token_ids, num_blocks=len(session.block_ids),
        weights_fingerprint=layout.weights_fingerprint,
    )  # fmt: skip
    return internal_pb2.KvHeader(**(fields | changes))


def chunks_of(engine: Engine, per_chunk: int = 1) -> list[internal_pb2.PushRequest]:
    [session] = idle_sessions(engine)
    out = []
    for first in range(0, len(session.block_ids), per_chunk):
        data = read_blocks(engine.runner.kv_caches, session.block_ids[first : first + per_chunk])
        chunk = internal_pb2.KvChunk(first_block=first, data=data, crc32=zlib.crc32(data))
        out.append(internal_pb2.PushRequest(chunk=chunk))
    return out


def test_a_corrupted_chunk_is_refused_and_the_receiver_keeps_nothing(sender, receiver):
    assert not push(sender, receiver.address, faults=Faults(corrupt_kv_chunks=True))
    assert receiver.idle()
    header = internal_pb2.PushRequest(header=header_of(sender))
    chunks = chunks_of(sender)
    chunks[2].chunk.data = b"\0" + chunks[2].chunk.data[1:]
    error = raw_push(receiver.address, [header, *chunks])
    assert error.code() == grpc.StatusCode.DATA_LOSS
    assert "block 2 failed its CRC-32" in error.details()
    assert receiver.idle()


def test_a_stream_that_ends_early_gives_its_blocks_back(sender, receiver):
    header = internal_pb2.PushRequest(header=header_of(sender))
    error = raw_push(receiver.address, [header, *chunks_of(sender)[:2]])
    assert error.code() == grpc.StatusCode.DATA_LOSS
    assert "ended after 2 of 4 blocks" in error.details()
    assert receiver.idle()


@pytest.mark.parametrize(
    ("changes", "code", "named"),
    [
        ({"kv_cache_dtype": "int8"}, "FAILED_PRECONDITION", "kv_cache_dtype differs"),
        ({"block_size": 32, "num_blocks": 2}, "FAILED_PRECONDITION", "block_size differs"),
        ({"model_id": "other"}, "FAILED_PRECONDITION", "model_id differs"),
        ({"num_blocks": 9}, "INVALID_ARGUMENT", "num_blocks 9"),
    ],
)
def test_another_layout_is_refused_naming_the_difference(sender, receiver, changes, code, named):
    header = internal_pb2.PushRequest(header=header_of(sender, **changes))
    error = raw_push(receiver.address, [header, *chunks_of(sender)])
    assert error.code().name == code and named in error.details()
    assert receiver.idle()


def test_a_receiver_with_no_room_refuses(sender):
    full = Receiver(make_engine(num_gpu_blocks=2), KvTransferConfig(port=0, secret=SECRET))
    try:
        header = internal_pb2.PushRequest(header=header_of(sender))
        error = raw_push(full.address, [header, *chunks_of(sender)])
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "no room for 4 KV blocks" in error.details()
        assert full.idle()
    finally:
        full.server.stop(None)


def test_a_draining_receiver_and_a_caller_without_the_secret_are_refused(sender):
    draining = Receiver(make_engine(), KvTransferConfig(port=0, secret=SECRET), lambda: False)
    try:
        header = internal_pb2.PushRequest(header=header_of(sender))
        error = raw_push(draining.address, [header, *chunks_of(sender)])
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "draining" in error.details()
        for secret in (None, "wrong"):
            error = raw_push(draining.address, [header], secret=secret)
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert draining.idle()
    finally:
        draining.server.stop(None)


def test_mutual_tls_takes_a_peer_with_a_client_certificate_only(sender, tmp_path: Path):
    ca = CertificateAuthority(tmp_path)
    service, client = ca.server("kv"), ca.client("executor-a")
    config = KvTransferConfig(port=0, tls_cert=service.cert, tls_key=service.key, tls_ca=ca.ca)
    secure = Receiver(make_engine(), config)
    try:
        tls = {"tls_ca": ca.ca, "tls_server_name": "localhost", "secret": None}
        assert not push(sender, secure.address, **tls)  # no client certificate
        assert secure.idle()
        assert push(sender, secure.address, client_cert=client.cert, client_key=client.key, **tls)
        assert [s.session_id for s in idle_sessions(secure.engine)] == ["chat"]
    finally:
        secure.server.stop(None)


def test_a_push_the_step_loop_never_gets_to_times_out_and_takes_nothing(sender):
    """A busy receiver whose step loop never runs the queued writes (a wedged loop): the push
    ends DEADLINE_EXCEEDED at the sender's timeout and the queued work never runs."""
    engine = make_engine()
    gate = EngineGate()
    gate.busy = True  # writes wait for run_pending, which nothing calls
    receiver = KvReceiver(engine, gate, ExecutorMetrics(), lambda: True, SECRET)
    server, address = start_kv_server(KvTransferConfig(port=0, secret=SECRET), receiver)
    try:
        assert not push(sender, address, timeout_s=1.0)
        # the receiver gives up its queued write at its own deadline (the client's may pass
        # first), then the loop comes back: the cancelled work must not run now
        wait_for(lambda: gate.waiting() == 0, "the receiver giving up its queued write")
        gate.run_pending()
        kv = engine.kv_cache
        assert kv.num_free_blocks == kv.num_blocks and not kv.sessions
    finally:
        server.stop(None)


def test_allowed_names_refuse_a_peer_certificate_that_names_none(sender, tmp_path: Path):
    ca = CertificateAuthority(tmp_path)
    service = ca.server("kv")
    config = KvTransferConfig(port=0, tls_cert=service.cert, tls_key=service.key, tls_ca=ca.ca)
    secure = Receiver(make_engine(), config, names=["executor-a", "executor-b"])
    try:
        tls = {"tls_ca": ca.ca, "tls_server_name": "localhost", "secret": None}
        stranger = ca.client("kvgate-gateway")
        assert not push(sender, secure.address, client_cert=stranger.cert,
                        client_key=stranger.key, **tls)  # fmt: skip
        assert secure.idle()
        peer = ca.client("executor-b")
        assert push(sender, secure.address, client_cert=peer.cert, client_key=peer.key, **tls)
    finally:
        secure.server.stop(None)
