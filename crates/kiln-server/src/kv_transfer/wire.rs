//! The KV transfer protocol's bytes: frames, the messages they carry, and the handshake's
//! keyed MACs.
//!
//! A frame is `[payload length: u32][kind: u8][payload][CRC-32 of kind and payload: u32]`,
//! little-endian. A reader states the largest payload it accepts before anything is
//! allocated, so a peer can never make it hold more than one block's bytes; a frame whose
//! checksum fails, whose kind is unknown, or whose payload does not parse exactly (bytes left
//! over included) is an error, and the connection is closed.
//!
//! The conversation (version 1): the server sends `Challenge` (magic, version, its nonce); the
//! client answers `Hello` (version, its nonce, `HMAC-SHA256(secret, "client" || server nonce ||
//! client nonce)`, its KV geometry and the engine id it expects); the server checks the MAC in
//! constant time, then the geometry and id, and answers `Welcome` with its own MAC
//! (`"server" || client nonce || server nonce`), which the client checks: each side proves it
//! knows the secret without sending it, and neither accepts a replayed answer (fresh nonces).
//! Then the client sends `Fetch` (a pin, the blocks wanted, the prompt's tokens, whether to
//! release the pin after); the server answers one `Block` frame per block in order, then
//! `Done`, or `Refused` with the reason at any point. `Release` drops a pin without fetching.

use sha2::{Digest, Sha256};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use kiln_engine::KvGeometry;

/// The protocol's version; a peer of another version is refused by name.
pub const VERSION: u32 = 1;
const MAGIC: &[u8; 8] = b"KILNKVT\0";
/// Bytes of a nonce and of a MAC.
pub const NONCE_BYTES: usize = 32;
/// The largest payload of a message other than `Block` and `Fetch`.
pub const MAX_CONTROL_PAYLOAD: usize = 4096;
/// The most blocks one `Fetch` may name (a 1M-token prompt in blocks of 16).
pub const MAX_FETCH_BLOCKS: u32 = 1 << 16;
/// The most prompt tokens one `Fetch` may carry.
pub const MAX_FETCH_TOKENS: u32 = 1 << 21;
/// The longest engine id or refusal message.
const MAX_TEXT: usize = 1024;

/// Why a conversation ended.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("the peer closed the connection")]
    Closed,
    #[error("a frame of {len} bytes, more than the {max} allowed here")]
    TooLarge { len: usize, max: usize },
    #[error("a frame failed its checksum")]
    Checksum,
    #[error("malformed message: {0}")]
    Malformed(String),
    #[error("refused by the peer: {0}")]
    Refused(String),
}

/// One message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    Challenge {
        version: u32,
        nonce: [u8; NONCE_BYTES],
    },
    Hello(Hello),
    Welcome {
        mac: [u8; NONCE_BYTES],
    },
    Fetch(Fetch),
    /// Block `index` of the fetch (counting from its first block), with its KV.
    Block {
        index: u32,
        data: Vec<u8>,
    },
    Done {
        blocks: u32,
    },
    Release {
        pin: u64,
    },
    Refused(String),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    pub version: u32,
    pub nonce: [u8; NONCE_BYTES],
    pub mac: [u8; NONCE_BYTES],
    pub geometry: KvGeometry,
    pub engine_id: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fetch {
    pub pin: u64,
    /// The first prompt block wanted and how many.
    pub first: u32,
    pub count: u32,
    pub release: bool,
    /// The importer's prompt tokens covering the pin (checked by the exporter).
    pub tokens: Vec<u32>,
}

const CHALLENGE: u8 = 1;
const HELLO: u8 = 2;
const WELCOME: u8 = 3;
const FETCH: u8 = 4;
const BLOCK: u8 = 5;
const DONE: u8 = 6;
const RELEASE: u8 = 7;
const REFUSED: u8 = 9;

/// A fresh random nonce.
pub fn nonce() -> std::io::Result<[u8; NONCE_BYTES]> {
    let mut n = [0u8; NONCE_BYTES];
    getrandom::fill(&mut n).map_err(|e| std::io::Error::other(e.to_string()))?;
    Ok(n)
}

/// HMAC-SHA256 (RFC 2104) of the concatenated `parts` under `key`.
pub fn hmac(key: &[u8], parts: &[&[u8]]) -> [u8; NONCE_BYTES] {
    const BLOCK_BYTES: usize = 64;
    let mut k = [0u8; BLOCK_BYTES];
    if key.len() > BLOCK_BYTES {
        k[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let mut inner = Sha256::new();
    inner.update(k.map(|b| b ^ 0x36));
    for p in parts {
        inner.update(p);
    }
    let mut outer = Sha256::new();
    outer.update(k.map(|b| b ^ 0x5c));
    outer.update(inner.finalize());
    outer.finalize().into()
}

/// The client's proof: it answers this server's nonce with its own.
pub fn client_mac(secret: &[u8], server: &[u8; 32], client: &[u8; 32]) -> [u8; 32] {
    hmac(secret, &[b"kiln-kv-transfer client", server, client])
}

/// The server's proof.
pub fn server_mac(secret: &[u8], server: &[u8; 32], client: &[u8; 32]) -> [u8; 32] {
    hmac(secret, &[b"kiln-kv-transfer server", client, server])
}

/// Writes `message` as one frame.
pub async fn write(out: &mut (impl AsyncWrite + Unpin), message: &Message) -> std::io::Result<()> {
    let (kind, payload) = encode(message);
    let mut frame = Vec::with_capacity(payload.len() + 9);
    frame.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    frame.push(kind);
    frame.extend_from_slice(&payload);
    let mut crc = crc32fast::Hasher::new();
    crc.update(&[kind]);
    crc.update(&payload);
    frame.extend_from_slice(&crc.finalize().to_le_bytes());
    out.write_all(&frame).await
}

/// Writes a `Block` frame of block `index` straight from `data` (the bytes [`write`] would
/// write for `Message::Block`, without copying the block).
pub async fn write_block(
    out: &mut (impl AsyncWrite + Unpin),
    index: u32,
    data: &[u8],
) -> std::io::Result<()> {
    let mut head = [0u8; 9];
    head[..4].copy_from_slice(&((data.len() + 4) as u32).to_le_bytes());
    head[4] = BLOCK;
    head[5..].copy_from_slice(&index.to_le_bytes());
    let mut crc = crc32fast::Hasher::new();
    crc.update(&head[4..]);
    crc.update(data);
    out.write_all(&head).await?;
    out.write_all(data).await?;
    out.write_all(&crc.finalize().to_le_bytes()).await
}

/// Reads a frame's length and kind; the peer closing the connection first is `Closed`.
async fn read_head(input: &mut (impl AsyncRead + Unpin)) -> Result<(usize, u8), WireError> {
    let mut head = [0u8; 5];
    match input.read_exact(&mut head).await {
        Ok(_) => Ok((u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize, head[4])),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Err(WireError::Closed),
        Err(e) => Err(e.into()),
    }
}

/// `read_exact` inside a frame: running out is a truncated frame.
async fn read_within(
    input: &mut (impl AsyncRead + Unpin),
    buf: &mut [u8],
) -> Result<(), WireError> {
    input.read_exact(buf).await.map(drop).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => WireError::Malformed("a truncated frame".into()),
        _ => e.into(),
    })
}

/// Reads one frame whose payload is at most `max` bytes and parses it.
pub async fn read(input: &mut (impl AsyncRead + Unpin), max: usize) -> Result<Message, WireError> {
    let (len, kind) = read_head(input).await?;
    read_body(input, len, kind, max).await
}

async fn read_body(
    input: &mut (impl AsyncRead + Unpin),
    len: usize,
    kind: u8,
    max: usize,
) -> Result<Message, WireError> {
    if len > max {
        return Err(WireError::TooLarge { len, max });
    }
    let mut body = vec![0u8; len + 4];
    read_within(input, &mut body).await?;
    let (payload, crc) = body.split_at(len);
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&[kind]);
    hasher.update(payload);
    if hasher.finalize().to_le_bytes() != crc {
        return Err(WireError::Checksum);
    }
    decode(kind, payload)
}

/// Reads one frame on the receiving end of a fetch: a `Block` of exactly `block_bytes` bytes
/// is appended to `out` (no intermediate copy) and its index returned as `Ok(Ok(index))`; any
/// other message, at most [`MAX_CONTROL_PAYLOAD`] bytes, as `Ok(Err(message))`. On an error
/// `out` is as it was.
pub async fn read_block_into(
    input: &mut (impl AsyncRead + Unpin),
    block_bytes: usize,
    out: &mut Vec<u8>,
) -> Result<Result<u32, Message>, WireError> {
    let (len, kind) = read_head(input).await?;
    if kind != BLOCK {
        return read_body(input, len, kind, MAX_CONTROL_PAYLOAD).await.map(Err);
    }
    if len != block_bytes + 4 {
        return Err(WireError::Malformed(format!(
            "a block frame of {len} bytes where {} were due",
            block_bytes + 4
        )));
    }
    let mut index = [0u8; 4];
    read_within(input, &mut index).await?;
    let start = out.len();
    out.resize(start + block_bytes, 0);
    let mut crc = [0u8; 4];
    let read = async {
        read_within(input, &mut out[start..]).await?;
        read_within(input, &mut crc).await
    };
    if let Err(e) = read.await {
        out.truncate(start);
        return Err(e);
    }
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&[BLOCK]);
    hasher.update(&index);
    hasher.update(&out[start..]);
    if hasher.finalize().to_le_bytes() != crc {
        out.truncate(start);
        return Err(WireError::Checksum);
    }
    Ok(Ok(u32::from_le_bytes(index)))
}

fn name_field(name: &str) -> [u8; 16] {
    let mut out = [0u8; 16];
    let n = name.len().min(16);
    out[..n].copy_from_slice(&name.as_bytes()[..n]);
    out
}

fn put_text(out: &mut Vec<u8>, text: &str) {
    let bytes = &text.as_bytes()[..text.len().min(MAX_TEXT)];
    out.extend_from_slice(&(bytes.len() as u16).to_le_bytes());
    out.extend_from_slice(bytes);
}

fn encode(message: &Message) -> (u8, Vec<u8>) {
    let mut p = Vec::new();
    let kind = match message {
        Message::Challenge { version, nonce } => {
            p.extend_from_slice(MAGIC);
            p.extend_from_slice(&version.to_le_bytes());
            p.extend_from_slice(nonce);
            CHALLENGE
        }
        Message::Hello(h) => {
            p.extend_from_slice(&h.version.to_le_bytes());
            p.extend_from_slice(&h.nonce);
            p.extend_from_slice(&h.mac);
            let g = &h.geometry;
            p.extend_from_slice(&g.model_fingerprint.to_le_bytes());
            p.extend_from_slice(&name_field(&g.backend));
            p.extend_from_slice(&name_field(&g.dtype));
            for x in [g.block_size, g.num_layers, g.num_kv_heads, g.head_dim] {
                p.extend_from_slice(&x.to_le_bytes());
            }
            p.extend_from_slice(&g.block_bytes.to_le_bytes());
            put_text(&mut p, &h.engine_id);
            HELLO
        }
        Message::Welcome { mac } => {
            p.extend_from_slice(mac);
            WELCOME
        }
        Message::Fetch(f) => {
            p.extend_from_slice(&f.pin.to_le_bytes());
            p.extend_from_slice(&f.first.to_le_bytes());
            p.extend_from_slice(&f.count.to_le_bytes());
            p.push(u8::from(f.release));
            p.extend_from_slice(&(f.tokens.len() as u32).to_le_bytes());
            for t in &f.tokens {
                p.extend_from_slice(&t.to_le_bytes());
            }
            FETCH
        }
        Message::Block { index, data } => {
            p.extend_from_slice(&index.to_le_bytes());
            p.extend_from_slice(data);
            BLOCK
        }
        Message::Done { blocks } => {
            p.extend_from_slice(&blocks.to_le_bytes());
            DONE
        }
        Message::Release { pin } => {
            p.extend_from_slice(&pin.to_le_bytes());
            RELEASE
        }
        Message::Refused(why) => {
            put_text(&mut p, why);
            REFUSED
        }
    };
    (kind, p)
}

/// Little-endian fields read off the front of a payload; running short is an error.
struct Fields<'a>(&'a [u8]);

impl Fields<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], WireError> {
        if self.0.len() < n {
            return Err(WireError::Malformed("a message shorter than its fields".into()));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }
    fn u32(&mut self) -> Result<u32, WireError> {
        self.array().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Result<u64, WireError> {
        self.array().map(u64::from_le_bytes)
    }
    fn name(&mut self) -> Result<String, WireError> {
        let raw: [u8; 16] = self.array()?;
        let end = raw.iter().position(|&b| b == 0).unwrap_or(16);
        Ok(String::from_utf8_lossy(&raw[..end]).into_owned())
    }
    fn text(&mut self) -> Result<String, WireError> {
        let len = u16::from_le_bytes(self.array()?) as usize;
        if len > MAX_TEXT {
            return Err(WireError::Malformed(format!("a text of {len} bytes")));
        }
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| WireError::Malformed("text not UTF-8".into()))
    }
    fn end(self) -> Result<(), WireError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(WireError::Malformed(format!("{} bytes after the message", self.0.len())))
        }
    }
}

fn decode(kind: u8, payload: &[u8]) -> Result<Message, WireError> {
    let mut f = Fields(payload);
    let message = match kind {
        CHALLENGE => {
            if f.array::<8>()? != *MAGIC {
                return Err(WireError::Malformed("not a kiln KV transfer server".into()));
            }
            Message::Challenge { version: f.u32()?, nonce: f.array()? }
        }
        HELLO => Message::Hello(Hello {
            version: f.u32()?,
            nonce: f.array()?,
            mac: f.array()?,
            geometry: KvGeometry {
                model_fingerprint: f.u64()?,
                backend: f.name()?,
                dtype: f.name()?,
                block_size: f.u32()?,
                num_layers: f.u32()?,
                num_kv_heads: f.u32()?,
                head_dim: f.u32()?,
                block_bytes: f.u64()?,
            },
            engine_id: f.text()?,
        }),
        WELCOME => Message::Welcome { mac: f.array()? },
        FETCH => {
            let (pin, first, count) = (f.u64()?, f.u32()?, f.u32()?);
            let release = match f.array::<1>()?[0] {
                0 => false,
                1 => true,
                b => return Err(WireError::Malformed(format!("release flag {b}"))),
            };
            let num_tokens = f.u32()?;
            if count > MAX_FETCH_BLOCKS || num_tokens > MAX_FETCH_TOKENS {
                return Err(WireError::Malformed(format!(
                    "a fetch of {count} blocks with {num_tokens} tokens"
                )));
            }
            let raw = f.take(num_tokens as usize * 4)?;
            let tokens =
                raw.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            Message::Fetch(Fetch { pin, first, count, release, tokens })
        }
        BLOCK => {
            let index = f.u32()?;
            let data = std::mem::take(&mut f.0).to_vec();
            Message::Block { index, data }
        }
        DONE => Message::Done { blocks: f.u32()? },
        RELEASE => Message::Release { pin: f.u64()? },
        REFUSED => Message::Refused(f.text()?),
        other => return Err(WireError::Malformed(format!("unknown message kind {other}"))),
    };
    f.end()?;
    Ok(message)
}

/// The largest `Fetch` payload.
pub const MAX_FETCH_PAYLOAD: usize = 8 + 4 + 4 + 1 + 4 + 4 * MAX_FETCH_TOKENS as usize;

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry() -> KvGeometry {
        KvGeometry {
            model_fingerprint: 7,
            backend: "cpu".into(),
            dtype: "f16".into(),
            block_size: 16,
            num_layers: 2,
            num_kv_heads: 1,
            head_dim: 8,
            block_bytes: 1024,
        }
    }

    fn all_messages() -> Vec<Message> {
        vec![
            Message::Challenge { version: VERSION, nonce: [3; 32] },
            Message::Hello(Hello {
                version: VERSION,
                nonce: [4; 32],
                mac: [5; 32],
                geometry: geometry(),
                engine_id: "engine-1".into(),
            }),
            Message::Welcome { mac: [6; 32] },
            Message::Fetch(Fetch { pin: 9, first: 1, count: 2, release: true, tokens: vec![1, 2] }),
            Message::Block { index: 1, data: vec![7; 100] },
            Message::Done { blocks: 2 },
            Message::Release { pin: 11 },
            Message::Refused("no".into()),
        ]
    }

    async fn frame_of(m: &Message) -> Vec<u8> {
        let mut out = Vec::new();
        write(&mut out, m).await.unwrap();
        out
    }

    #[tokio::test]
    async fn every_message_round_trips() {
        for m in all_messages() {
            let bytes = frame_of(&m).await;
            assert_eq!(read(&mut bytes.as_slice(), 1 << 20).await.unwrap(), m);
        }
    }

    #[tokio::test]
    async fn corrupted_truncated_and_oversized_frames_are_refused() {
        for m in all_messages() {
            let bytes = frame_of(&m).await;
            // Every single-bit flip past the length is caught by the checksum (or the length).
            for i in 4..bytes.len() {
                let mut bad = bytes.clone();
                bad[i] ^= 0x10;
                assert!(read(&mut bad.as_slice(), 1 << 20).await.is_err(), "{m:?} byte {i}");
            }
            for cut in 0..bytes.len() {
                assert!(read(&mut &bytes[..cut], 1 << 20).await.is_err(), "{m:?} cut at {cut}");
            }
        }
        let block = frame_of(&Message::Block { index: 0, data: vec![0; 200] }).await;
        assert!(matches!(
            read(&mut block.as_slice(), 100).await,
            Err(WireError::TooLarge { len: 204, max: 100 })
        ));
        // A well-formed frame of an unknown kind, and one with bytes left over.
        let mut unknown = frame_of(&Message::Done { blocks: 1 }).await;
        unknown[4] = 42;
        let crc = crc32fast::hash(&unknown[4..unknown.len() - 4]);
        let n = unknown.len();
        unknown[n - 4..].copy_from_slice(&crc.to_le_bytes());
        assert!(matches!(read(&mut unknown.as_slice(), 64).await, Err(WireError::Malformed(_))));
    }

    fn hex(bytes: &[u8]) -> String {
        use std::fmt::Write;
        bytes.iter().fold(String::new(), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
    }

    #[tokio::test]
    async fn blocks_are_written_and_read_in_place() {
        let data: Vec<u8> = (0..100u8).collect();
        let mut direct = Vec::new();
        write_block(&mut direct, 3, &data).await.unwrap();
        assert_eq!(direct, frame_of(&Message::Block { index: 3, data: data.clone() }).await);
        let mut out = vec![9u8];
        let index = read_block_into(&mut direct.as_slice(), 100, &mut out).await.unwrap();
        assert_eq!((index.unwrap(), &out[1..]), (3, data.as_slice()));
        // Another message passes through; a corrupted, truncated or mis-sized block leaves
        // `out` as it was.
        let done = frame_of(&Message::Done { blocks: 1 }).await;
        let got = read_block_into(&mut done.as_slice(), 100, &mut out).await.unwrap();
        assert_eq!(got, Err(Message::Done { blocks: 1 }));
        let mut bad = direct.clone();
        bad[50] ^= 4;
        assert!(matches!(
            read_block_into(&mut bad.as_slice(), 100, &mut out).await,
            Err(WireError::Checksum)
        ));
        assert!(read_block_into(&mut &direct[..60], 100, &mut out).await.is_err());
        assert!(matches!(
            read_block_into(&mut direct.as_slice(), 99, &mut out).await,
            Err(WireError::Malformed(_))
        ));
        assert_eq!(out.len(), 101);
    }

    #[test]
    fn hmac_matches_rfc_4231_cases_2_and_6() {
        let mac = hmac(b"Jefe", &[b"what do ya want ", b"for nothing?"]);
        let want = "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843";
        assert_eq!(hex(&mac), want);
        let long_key = [0xaa; 131];
        let mac = hmac(&long_key, &[b"Test Using Larger Than Block-Size Key - Hash Key First"]);
        let want = "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54";
        assert_eq!(hex(&mac), want);
        assert_ne!(client_mac(b"k", &[1; 32], &[2; 32]), server_mac(b"k", &[1; 32], &[2; 32]));
    }
}
