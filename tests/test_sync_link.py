"""The link between group leaders (:mod:`hetero_comm.sync.link`): every message kind through its
frame and back, malformed frames refused with a clear error, and typed messages between two real
gloo ranks."""

import pytest
import torch

from lab.launch import run_ranks
from hetero_comm.sync.link import Framing, MalformedFrameError, Message, MessageKind

import sync_workers

PAYLOAD_BYTES = (12, 0, 5)  # a part with nothing on the wire is a valid part


def assert_same(decoded: Message, message: Message) -> None:
    assert type(decoded.kind) is MessageKind and decoded.kind is message.kind
    assert (decoded.source, decoded.version, decoded.part, decoded.seen) == \
        (message.source, message.version, message.part, message.seen)
    assert decoded.payload.dtype == torch.uint8 and torch.equal(decoded.payload, message.payload)


def messages():
    g = torch.Generator().manual_seed(0)
    for kind in (MessageKind.CONTRIBUTION, MessageKind.FLUSH):
        for part, size in enumerate(PAYLOAD_BYTES):
            payload = torch.randint(0, 256, (size,), generator=g, dtype=torch.uint8)
            yield Message(kind, 2, 7 + part, part, (3, 0, 7 + part), payload)
    yield Message(MessageKind.CLOSE, 1, 9, 0, (9, 9, 8), torch.empty(0, dtype=torch.uint8))


@pytest.mark.parametrize("message", list(messages()), ids=lambda m: f"{m.kind.name}-{m.part}")
def test_every_message_kind_survives_its_frame(message):
    framing = Framing(3, PAYLOAD_BYTES)
    frame = framing.encode(message)
    assert frame.dtype == torch.uint8 and frame.numel() == framing.frame_bytes(message.part)
    assert framing.header_bytes == 8 * 6
    assert_same(framing.decode(frame, message.source), message)
    assert_same(framing.decode(frame.clone(), message.source), message)  # no state kept


def test_the_header_is_kind_version_part_then_seen_as_int64():
    framing = Framing(2, (4,))
    payload = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    frame = framing.encode(Message(MessageKind.FLUSH, 0, 5, 0, (6, 5), payload))
    assert frame[:framing.header_bytes].view(torch.int64).tolist() == [1, 5, 0, 6, 5]
    assert frame[framing.header_bytes:].tolist() == [1, 2, 3, 4]


def header(*values):
    return torch.tensor(values, dtype=torch.int64).view(torch.uint8)


@pytest.mark.parametrize("frame, match", [
    (header(0, 0, 0, 0, 0), "part 0 needs 44 bytes; got 40"),  # the payload is missing
    (torch.cat([header(0, 0, 0, 0, 0), torch.zeros(5, dtype=torch.uint8)]), "needs 44 bytes; got 45"),
    (torch.cat([header(7, 0, 0, 0, 0), torch.zeros(4, dtype=torch.uint8)]), "kind must be one of"),
    (torch.cat([header(0, 0, 2, 0, 0), torch.zeros(4, dtype=torch.uint8)]), r"part in \[0, 1\]"),
    (torch.cat([header(0, -1, 0, 0, 0), torch.zeros(4, dtype=torch.uint8)]), "version must be >= 0"),
    (torch.cat([header(0, 0, 0, 0, -3), torch.zeros(4, dtype=torch.uint8)]), "seen needs 2 counts"),
    (torch.cat([header(2, 0, 1, 0, 0), torch.zeros(6, dtype=torch.uint8)]), "CLOSE message is sized as part 0"),
    (torch.zeros(16, dtype=torch.uint8), "at least 40 bytes"),
    (torch.zeros(44, dtype=torch.int8), "1-D uint8"),
])
def test_a_malformed_frame_raises_a_clear_error(frame, match):
    framing = Framing(2, (4, 6))
    with pytest.raises(MalformedFrameError, match=match) as raised:
        framing.decode(frame, 1)
    assert "group 1" in str(raised.value)


def test_a_message_that_does_not_fit_its_part_is_not_encoded():
    framing = Framing(2, (4,))
    with pytest.raises(ValueError, match="4 bytes"):
        framing.encode(Message(MessageKind.CONTRIBUTION, 0, 0, 0, (0, 0), torch.zeros(3, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="seen needs 2"):
        framing.encode(Message(MessageKind.CONTRIBUTION, 0, 0, 0, (0,), torch.zeros(4, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="payload_bytes"):
        Framing(2, ())


@pytest.mark.multirank
def test_typed_messages_between_two_leaders_and_a_malformed_frame_fails_the_link():
    _, received = run_ranks(2, sync_workers.link_exchange, timeout=120)
    sent = list(sync_workers.link_messages())
    kinds = [m.kind for m in received[:-1]]
    assert kinds == [m.kind for m in sent]
    for got, message in zip(received[:-1], sent):
        assert (got.source, got.version, got.part, got.seen) == (0, message.version, message.part,
                                                                 message.seen)
        assert torch.equal(got.payload, message.payload)
    assert "stalled or died" in received[-1] and "malformed frame from group 0" in received[-1]
