//! ZMTP 3.x, the ZeroMQ wire protocol (rfc.zeromq.org/spec/23, with /spec/37's commands), as
//! the server side of kiln's KV event sockets speaks it, without any I/O: the greeting, the
//! NULL mechanism's READY with its properties, commands (SUBSCRIBE, CANCEL, PING, PONG, ERROR)
//! and the frame codec, with multipart messages. Only what a PUB or ROUTER socket that binds
//! needs: no other security mechanism, no ZMTP 1.0/2.0 peers.
//!
//! Invariants (the decoder faces any peer that can reach the port):
//! - every size a peer declares (a frame's length, a property's length, a command name's
//!   length) is checked against what the [`Limits`] and the bytes at hand allow BEFORE anything
//!   is allocated for it; a frame body is only copied once all of it has arrived, so a
//!   [`PeerDecoder`] holds at most one partial message of [`Limits::message_bytes`] bytes in
//!   [`Limits::message_frames`] frames;
//! - a decoder's caller keeps the unread bytes in its own buffer and appends a bounded chunk
//!   only when [`PeerDecoder::next`] asks for more (`Ok(None)`): the buffer then never holds
//!   more than the 9-byte header, a frame within the limits and one chunk;
//! - a peer that breaks the protocol or a limit gets an error ([`ZmtpError`]), never a panic;
//!   its connection is then closed, and nothing else changes.
//!
//! Decoding is linear in the bytes fed; property and subscription lookups are linear in the
//! (bounded) number of entries.

use bytes::{Buf, Bytes, BytesMut};

/// The greeting's length: signature (10), version (2), mechanism (20), as-server (1), filler.
pub(crate) const GREETING_LEN: usize = 64;
/// The version kiln announces; peers at 3.0 are served too (they send subscriptions as
/// messages, 3.1 peers as commands).
const VERSION: [u8; 2] = [3, 1];
/// The NULL mechanism's name, padded with zeros to 20 bytes.
const MECHANISM_NULL: &[u8; 20] = b"NULL\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0";

/// More frames of this message follow.
const FLAG_MORE: u8 = 0x01;
/// The size is 8 bytes (big-endian) instead of 1.
const FLAG_LONG: u8 = 0x02;
/// The frame is a command, not part of a message.
const FLAG_COMMAND: u8 = 0x04;
/// Bits 3-7 are reserved and must be zero.
const FLAGS_KNOWN: u8 = FLAG_MORE | FLAG_LONG | FLAG_COMMAND;

/// The longest PING context (/spec/37).
const MAX_PING_CONTEXT: usize = 16;
/// The longest peer `Identity` (libzmq's routing id limit).
pub(crate) const MAX_IDENTITY: usize = 255;

/// Caps on what one peer may send.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Limits {
    /// The largest frame body (commands included) a peer may declare.
    pub frame_bytes: usize,
    /// The most frames in one multipart message.
    pub message_frames: usize,
    /// The largest sum of the frame bodies of one multipart message.
    pub message_bytes: usize,
}

/// The caps for peers of kiln's KV event sockets: a subscriber sends subscriptions (a topic
/// prefix) and a replay client `["", start_seq]`; READY carries a few short properties.
pub(crate) const PEER_LIMITS: Limits =
    Limits { frame_bytes: 8 * 1024, message_frames: 16, message_bytes: 16 * 1024 };

/// Why a peer's bytes were refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum ZmtpError {
    #[error("not a ZMTP 3 greeting")]
    BadSignature,
    #[error("unsupported ZMTP version {0}.x (3.x needed)")]
    UnsupportedVersion(u8),
    #[error("unsupported security mechanism (only NULL)")]
    UnsupportedMechanism,
    #[error("reserved frame flags set: {0:#04x}")]
    ReservedFlags(u8),
    #[error("a frame declares {declared} bytes, more than the {limit} allowed")]
    FrameTooLarge { declared: u64, limit: usize },
    #[error("more than {0} frames in one message")]
    TooManyFrames(usize),
    #[error("a command frame has the MORE flag")]
    CommandWithMore,
    #[error("a command inside a multipart message")]
    CommandInMessage,
    #[error("malformed command: {0}")]
    MalformedCommand(&'static str),
    #[error("expected READY first, got {0}")]
    ExpectedReady(&'static str),
    #[error("READY sent twice")]
    UnexpectedReady,
    #[error("READY has no Socket-Type")]
    MissingSocketType,
    #[error("incompatible peer Socket-Type {0:?}")]
    IncompatibleSocketType(String),
    #[error("peer Identity longer than {MAX_IDENTITY} bytes")]
    IdentityTooLong,
    #[error("peer sent ERROR: {0:?}")]
    PeerError(String),
    #[error("{0}")]
    Limit(&'static str),
}

/// Kiln's greeting: ZMTP 3.1, NULL mechanism, not as-server.
pub(crate) fn greeting() -> [u8; GREETING_LEN] {
    let mut g = [0u8; GREETING_LEN];
    g[0] = 0xFF;
    g[9] = 0x7F;
    g[10..12].copy_from_slice(&VERSION);
    g[12..32].copy_from_slice(MECHANISM_NULL);
    g
}

/// Checks a peer's greeting as far as `buf` goes (so a peer that is not speaking ZMTP is
/// refused at its first byte); `Ok(Some(minor version))` once all 64 bytes are there and good.
pub(crate) fn decode_greeting(buf: &[u8]) -> Result<Option<u8>, ZmtpError> {
    if buf.first().is_some_and(|&b| b != 0xFF) || buf.get(9).is_some_and(|&b| b & 1 == 0) {
        return Err(ZmtpError::BadSignature);
    }
    if let Some(&major) = buf.get(10)
        && major < 3
    {
        return Err(ZmtpError::UnsupportedVersion(major));
    }
    let mechanism = &buf[12.min(buf.len())..32.min(buf.len())];
    if mechanism != &MECHANISM_NULL[..mechanism.len()] {
        return Err(ZmtpError::UnsupportedMechanism);
    }
    Ok((buf.len() >= GREETING_LEN).then(|| buf[11]))
}

/// One frame as it came.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Frame {
    pub more: bool,
    pub command: bool,
    pub body: Bytes,
}

/// Decodes the frame at the front of `buf`, refusing a declared size above `max` from the
/// header alone; `Ok(None)` while the frame is incomplete; else the frame and its length.
pub(crate) fn decode_frame(buf: &[u8], max: usize) -> Result<Option<(Frame, usize)>, ZmtpError> {
    let Some(&flags) = buf.first() else { return Ok(None) };
    if flags & !FLAGS_KNOWN != 0 {
        return Err(ZmtpError::ReservedFlags(flags));
    }
    let (declared, header) = if flags & FLAG_LONG == 0 {
        let Some(&size) = buf.get(1) else { return Ok(None) };
        (u64::from(size), 2)
    } else {
        let Some(size) = buf.get(1..9) else { return Ok(None) };
        let mut be = [0u8; 8];
        be.copy_from_slice(size);
        (u64::from_be_bytes(be), 9)
    };
    let len = usize::try_from(declared)
        .ok()
        .filter(|&len| len <= max)
        .ok_or(ZmtpError::FrameTooLarge { declared, limit: max })?;
    let Some(body) = buf.get(header..header + len) else { return Ok(None) };
    let frame = Frame {
        more: flags & FLAG_MORE != 0,
        command: flags & FLAG_COMMAND != 0,
        body: Bytes::copy_from_slice(body),
    };
    Ok(Some((frame, header + len)))
}

/// Appends the header of a frame of `len` bytes (short form up to 255, long form above).
pub(crate) fn encode_frame_header(out: &mut Vec<u8>, flags: u8, len: usize) {
    if let Ok(size) = u8::try_from(len) {
        out.extend([flags, size]);
    } else {
        out.push(flags | FLAG_LONG);
        out.extend((len as u64).to_be_bytes());
    }
}

/// Appends one frame.
pub(crate) fn encode_frame(out: &mut Vec<u8>, flags: u8, body: &[u8]) {
    encode_frame_header(out, flags, body.len());
    out.extend_from_slice(body);
}

/// The flags of frame `i` of a message of `len` frames: MORE on all but the last.
pub(crate) fn message_flags(i: usize, len: usize) -> u8 {
    if i + 1 < len { FLAG_MORE } else { 0 }
}

/// A multipart message on the wire, encoded once (one copy of its frames).
pub(crate) fn encode_message(frames: &[Bytes]) -> Bytes {
    let mut out = Vec::with_capacity(frames.iter().map(|f| f.len() + 9).sum());
    for (i, frame) in frames.iter().enumerate() {
        encode_frame(&mut out, message_flags(i, frames.len()), frame);
    }
    Bytes::from(out)
}

/// A command frame: the name's length, the name, the data.
fn encode_command(name: &str, data: &[u8]) -> Vec<u8> {
    let mut body = Vec::with_capacity(1 + name.len() + data.len());
    body.push(name.len() as u8);
    body.extend_from_slice(name.as_bytes());
    body.extend_from_slice(data);
    let mut out = Vec::with_capacity(body.len() + 9);
    encode_frame(&mut out, FLAG_COMMAND, &body);
    out
}

/// Kiln's READY: `Socket-Type`, and an empty `Identity` where libzmq sends one (ROUTER).
pub(crate) fn ready_command(socket_type: &str, with_identity: bool) -> Vec<u8> {
    let mut data = Vec::new();
    let mut property = |name: &str, value: &[u8]| {
        data.push(name.len() as u8);
        data.extend_from_slice(name.as_bytes());
        data.extend((value.len() as u32).to_be_bytes());
        data.extend_from_slice(value);
    };
    property("Socket-Type", socket_type.as_bytes());
    if with_identity {
        property("Identity", b"");
    }
    encode_command("READY", &data)
}

/// The PONG answering a PING's context.
pub(crate) fn pong_command(context: &[u8]) -> Vec<u8> {
    encode_command("PONG", context)
}

/// The properties of a peer's READY that kiln reads (names match case-insensitively).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Ready {
    pub socket_type: Bytes,
    /// Empty when the peer sent none.
    pub identity: Bytes,
}

/// A command after the handshake.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Command {
    Subscribe(Bytes),
    Cancel(Bytes),
    /// A heartbeat to answer with [`pong_command`] and this context.
    Ping(Bytes),
    /// PONG, or a command kiln does not use: ignored.
    Ignored,
}

/// Splits a command body into its name and data.
fn split_command(body: &Bytes) -> Result<(&[u8], Bytes), ZmtpError> {
    let Some((&len, rest)) = body.split_first() else {
        return Err(ZmtpError::MalformedCommand("empty"));
    };
    let len = usize::from(len);
    if len == 0 || rest.len() < len {
        return Err(ZmtpError::MalformedCommand("bad name length"));
    }
    Ok((&rest[..len], body.slice(1 + len..)))
}

/// The properties of a READY command's data: `name-size name value-size(4, BE) value`, each.
fn parse_ready(data: &Bytes) -> Result<Ready, ZmtpError> {
    let malformed = || ZmtpError::MalformedCommand("bad READY property");
    let (mut socket_type, mut identity) = (None, Bytes::new());
    let mut at = 0;
    while at < data.len() {
        let name_len = usize::from(data[at]);
        let name = data.get(at + 1..at + 1 + name_len).filter(|n| !n.is_empty());
        let name = name.ok_or_else(malformed)?;
        at += 1 + name_len;
        let size = data.get(at..at + 4).ok_or_else(malformed)?;
        let size = u32::from_be_bytes([size[0], size[1], size[2], size[3]]) as usize;
        at += 4;
        // `size` is compared with the bytes at hand before anything is sliced.
        if size > data.len() - at {
            return Err(malformed());
        }
        let value = data.slice(at..at + size);
        at += size;
        if name.eq_ignore_ascii_case(b"Socket-Type") {
            socket_type.get_or_insert(value);
        } else if name.eq_ignore_ascii_case(b"Identity") {
            if value.len() > MAX_IDENTITY {
                return Err(ZmtpError::IdentityTooLong);
            }
            identity = value;
        }
    }
    let socket_type = socket_type.ok_or(ZmtpError::MissingSocketType)?;
    Ok(Ready { socket_type, identity })
}

/// A command frame's meaning, READY excluded (see [`PeerDecoder`]).
fn parse_command(name: &[u8], data: Bytes) -> Result<Command, ZmtpError> {
    Ok(match name {
        b"SUBSCRIBE" => Command::Subscribe(data),
        b"CANCEL" => Command::Cancel(data),
        b"PING" => {
            if data.len() < 2 || data.len() - 2 > MAX_PING_CONTEXT {
                return Err(ZmtpError::MalformedCommand("bad PING"));
            }
            Command::Ping(data.slice(2..))
        }
        b"READY" => return Err(ZmtpError::UnexpectedReady),
        b"ERROR" => {
            let reason = data.get(1..).unwrap_or_default();
            return Err(ZmtpError::PeerError(String::from_utf8_lossy(reason).into_owned()));
        }
        _ => Command::Ignored,
    })
}

/// What a peer sent, in order: its greeting, its READY, then commands and messages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Event {
    /// A good ZMTP 3 greeting with the NULL mechanism, with its minor version.
    Greeting(u8),
    Ready(Ready),
    Command(Command),
    /// A whole multipart message (at least one frame).
    Message(Vec<Bytes>),
}

/// Where a peer is in the protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Greeting,
    Ready,
    Traffic,
}

/// Decodes one peer's stream into [`Event`]s, within [`Limits`].
#[derive(Debug)]
pub(crate) struct PeerDecoder {
    limits: Limits,
    stage: Stage,
    /// The frames of the message being received, and the sum of their lengths.
    partial: Vec<Bytes>,
    partial_len: usize,
}

impl PeerDecoder {
    pub(crate) fn new(limits: Limits) -> Self {
        Self { limits, stage: Stage::Greeting, partial: Vec::new(), partial_len: 0 }
    }

    /// Takes the next event from the front of `buf` (consuming its bytes); `Ok(None)` when
    /// `buf` holds no whole event yet: the caller appends more bytes and calls again. After an
    /// error the stream is broken: the caller closes the connection.
    pub(crate) fn next(&mut self, buf: &mut BytesMut) -> Result<Option<Event>, ZmtpError> {
        if self.stage == Stage::Greeting {
            let Some(minor) = decode_greeting(buf)? else { return Ok(None) };
            buf.advance(GREETING_LEN);
            self.stage = Stage::Ready;
            return Ok(Some(Event::Greeting(minor)));
        }
        loop {
            // A message's frames share its budget, so its total is capped at the header too.
            let budget = self.limits.frame_bytes.min(self.limits.message_bytes - self.partial_len);
            let Some((frame, used)) = decode_frame(buf, budget)? else { return Ok(None) };
            buf.advance(used);
            if let Some(event) = self.on_frame(frame)? {
                return Ok(Some(event));
            }
        }
    }

    /// One whole frame: an event, or `None` for a message's frame with more to come.
    fn on_frame(&mut self, frame: Frame) -> Result<Option<Event>, ZmtpError> {
        if frame.command {
            if frame.more {
                return Err(ZmtpError::CommandWithMore);
            }
            if !self.partial.is_empty() {
                return Err(ZmtpError::CommandInMessage);
            }
            let (name, data) = split_command(&frame.body)?;
            if self.stage == Stage::Ready {
                if name != b"READY" {
                    return Err(ZmtpError::ExpectedReady("another command"));
                }
                self.stage = Stage::Traffic;
                return Ok(Some(Event::Ready(parse_ready(&data)?)));
            }
            return parse_command(name, data).map(|c| Some(Event::Command(c)));
        }
        if self.stage == Stage::Ready {
            return Err(ZmtpError::ExpectedReady("a message"));
        }
        if self.partial.len() == self.limits.message_frames {
            return Err(ZmtpError::TooManyFrames(self.limits.message_frames));
        }
        self.partial_len += frame.body.len();
        self.partial.push(frame.body);
        if frame.more {
            return Ok(None);
        }
        self.partial_len = 0;
        Ok(Some(Event::Message(std::mem::take(&mut self.partial))))
    }
}

#[cfg(test)]
mod tests {
    use bytes::{Bytes, BytesMut};

    use super::*;

    /// A peer's READY with these properties.
    fn ready(properties: &[(&str, &[u8])]) -> Vec<u8> {
        let mut data = Vec::new();
        for (name, value) in properties {
            data.push(name.len() as u8);
            data.extend(name.as_bytes());
            data.extend((value.len() as u32).to_be_bytes());
            data.extend(*value);
        }
        encode_command("READY", &data)
    }

    /// Feeds `bytes` one at a time and collects the events, or the first error.
    fn events(bytes: &[u8]) -> Result<Vec<Event>, ZmtpError> {
        let mut decoder = PeerDecoder::new(PEER_LIMITS);
        let mut buf = BytesMut::new();
        let mut out = Vec::new();
        for &b in bytes {
            buf.extend_from_slice(&[b]);
            while let Some(event) = decoder.next(&mut buf)? {
                out.push(event);
            }
        }
        Ok(out)
    }

    fn handshake() -> Vec<u8> {
        let mut bytes = greeting().to_vec();
        bytes.extend(ready(&[("Socket-Type", b"SUB")]));
        bytes
    }

    #[test]
    fn short_and_long_frames_round_trip() {
        for len in [0, 1, 255, 256, 5000] {
            let body = vec![7u8; len];
            let mut wire = Vec::new();
            encode_frame(&mut wire, FLAG_MORE, &body);
            assert_eq!(wire.len(), body.len() + if len <= 255 { 2 } else { 9 });
            assert_eq!(wire[0] & FLAG_LONG != 0, len > 255);
            for cut in 0..wire.len() {
                assert_eq!(decode_frame(&wire[..cut], 8192), Ok(None), "{len} cut at {cut}");
            }
            let (frame, used) = decode_frame(&wire, 8192).unwrap().unwrap();
            assert_eq!((frame.more, frame.command, used), (true, false, wire.len()));
            assert_eq!(frame.body, body);
        }
        // A long header may carry a small size.
        let wire = [FLAG_LONG, 0, 0, 0, 0, 0, 0, 0, 2, b'h', b'i'];
        assert_eq!(decode_frame(&wire, 10).unwrap().unwrap().0.body, &b"hi"[..]);
        let message = encode_message(&[Bytes::from_static(b"t"), Bytes::new()]);
        assert_eq!(&message[..], &[FLAG_MORE, 1, b't', 0, 0]);
    }

    #[test]
    fn a_declared_size_over_the_cap_is_refused_from_the_header_alone() {
        let mut huge = vec![FLAG_LONG];
        huge.extend((1u64 << 40).to_be_bytes());
        let err = ZmtpError::FrameTooLarge { declared: 1 << 40, limit: 8192 };
        assert_eq!(decode_frame(&huge, 8192), Err(err));
        let mut max = vec![FLAG_LONG];
        max.extend(u64::MAX.to_be_bytes());
        assert!(matches!(decode_frame(&max, 8192), Err(ZmtpError::FrameTooLarge { .. })));
        assert!(matches!(decode_frame(&[0, 200], 100), Err(ZmtpError::FrameTooLarge { .. })));
        assert_eq!(decode_frame(&[0x08, 0], 100), Err(ZmtpError::ReservedFlags(0x08)));
        // Through the decoder, after a good handshake.
        let mut bytes = handshake();
        bytes.extend(&huge);
        assert!(matches!(events(&bytes), Err(ZmtpError::FrameTooLarge { .. })));
    }

    #[test]
    fn a_message_is_capped_in_frames_and_bytes() {
        let mut bytes = handshake();
        for _ in 0..=PEER_LIMITS.message_frames {
            encode_frame(&mut bytes, FLAG_MORE, b"x");
        }
        assert_eq!(events(&bytes), Err(ZmtpError::TooManyFrames(PEER_LIMITS.message_frames)));
        // Each frame within frame_bytes, the sum over message_bytes: refused at the last header.
        let mut bytes = handshake();
        let chunk = vec![0u8; PEER_LIMITS.frame_bytes];
        for _ in 0..PEER_LIMITS.message_bytes / PEER_LIMITS.frame_bytes {
            encode_frame(&mut bytes, FLAG_MORE, &chunk);
        }
        bytes.extend([0, 1]);
        assert!(matches!(events(&bytes), Err(ZmtpError::FrameTooLarge { limit: 0, .. })));
    }

    #[test]
    fn a_malformed_greeting_is_refused_at_its_first_bad_byte() {
        assert_eq!(decode_greeting(b""), Ok(None));
        assert_eq!(decode_greeting(b"GET / HTTP/1.1"), Err(ZmtpError::BadSignature));
        let good = greeting();
        assert_eq!(decode_greeting(&good[..40]), Ok(None));
        assert_eq!(decode_greeting(&good), Ok(Some(1)));
        let mut zmtp1 = good;
        zmtp1[9] = 0x7E;
        assert_eq!(decode_greeting(&zmtp1[..10]), Err(ZmtpError::BadSignature));
        let mut v2 = good;
        v2[10] = 2;
        assert_eq!(decode_greeting(&v2[..11]), Err(ZmtpError::UnsupportedVersion(2)));
        let mut plain = good;
        plain[12..17].copy_from_slice(b"PLAIN");
        assert_eq!(decode_greeting(&plain[..14]), Err(ZmtpError::UnsupportedMechanism));
        // A ZMTP 3.0 peer, with libzmq's signature padding and junk in the filler.
        let mut v30 = good;
        (v30[8], v30[11], v30[40]) = (1, 0, 0xAA);
        assert_eq!(decode_greeting(&v30), Ok(Some(0)));
    }

    #[test]
    fn the_handshake_reads_ready_properties_and_refuses_anything_else_first() {
        let mut bytes = greeting().to_vec();
        bytes.extend(ready(&[("x-extra", b"1"), ("socket-type", b"DEALER"), ("Identity", b"me")]));
        let got = events(&bytes).unwrap();
        let want = Ready { socket_type: Bytes::from_static(b"DEALER"), identity: "me".into() };
        assert_eq!(got, [Event::Greeting(1), Event::Ready(want)]);
        let mut no_type = greeting().to_vec();
        no_type.extend(ready(&[("Identity", b"")]));
        assert_eq!(events(&no_type), Err(ZmtpError::MissingSocketType));
        let mut long_id = greeting().to_vec();
        long_id.extend(ready(&[("Socket-Type", b"DEALER"), ("Identity", &[1; 256])]));
        assert_eq!(events(&long_id), Err(ZmtpError::IdentityTooLong));
        // A value size past the command's end.
        let mut bad = greeting().to_vec();
        let mut data = vec![1, b'a'];
        data.extend(u32::MAX.to_be_bytes());
        bad.extend(encode_command("READY", &data));
        assert!(matches!(events(&bad), Err(ZmtpError::MalformedCommand(_))));
        let mut message_first = greeting().to_vec();
        encode_frame(&mut message_first, 0, b"hi");
        assert_eq!(events(&message_first), Err(ZmtpError::ExpectedReady("a message")));
        let mut twice = handshake();
        twice.extend(ready(&[("Socket-Type", b"SUB")]));
        assert_eq!(events(&twice), Err(ZmtpError::UnexpectedReady));
    }

    #[test]
    fn commands_and_messages_after_the_handshake() {
        let mut bytes = handshake();
        bytes.extend(encode_command("SUBSCRIBE", b"kv"));
        bytes.extend(encode_command("CANCEL", b""));
        bytes.extend(encode_command("PING", b"\x00\x0actx"));
        bytes.extend(encode_command("PONG", b""));
        bytes.extend(encode_message(&[Bytes::new(), Bytes::from_static(b"12345678")]));
        let got = events(&bytes).unwrap();
        assert_eq!(
            got[2..],
            [
                Event::Command(Command::Subscribe("kv".into())),
                Event::Command(Command::Cancel(Bytes::new())),
                Event::Command(Command::Ping("ctx".into())),
                Event::Command(Command::Ignored),
                Event::Message(vec![Bytes::new(), Bytes::from_static(b"12345678")]),
            ]
        );
        assert_eq!(
            pong_command(b"ctx"),
            [FLAG_COMMAND, 8, 4, b'P', b'O', b'N', b'G', b'c', b't', b'x']
        );
        let refused: [(&[u8], ZmtpError); 5] = [
            (&[FLAG_COMMAND, 0], ZmtpError::MalformedCommand("empty")),
            (&[FLAG_COMMAND, 2, 5, b'R'], ZmtpError::MalformedCommand("bad name length")),
            (&[FLAG_COMMAND | FLAG_MORE, 0], ZmtpError::CommandWithMore),
            (&[FLAG_MORE, 0, FLAG_COMMAND, 0], ZmtpError::CommandInMessage),
            (
                &[FLAG_COMMAND, 6, 4, b'P', b'I', b'N', b'G', 0],
                ZmtpError::MalformedCommand("bad PING"),
            ),
        ];
        for (tail, want) in refused {
            let mut bytes = handshake();
            bytes.extend(tail);
            assert_eq!(events(&bytes), Err(want), "{tail:?}");
        }
        let mut error = handshake();
        error.extend(encode_command("ERROR", b"\x03bye"));
        assert_eq!(events(&error), Err(ZmtpError::PeerError("bye".into())));
    }

    #[test]
    fn kilns_own_greeting_and_ready_decode() {
        let mut bytes = greeting().to_vec();
        bytes.extend(ready_command("ROUTER", true));
        let want = Ready { socket_type: "ROUTER".into(), identity: Bytes::new() };
        assert_eq!(events(&bytes).unwrap(), [Event::Greeting(1), Event::Ready(want)]);
    }
}
