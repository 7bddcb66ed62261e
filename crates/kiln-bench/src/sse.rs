//! Incremental server-sent-events parsing: bytes in (split anywhere, even inside a UTF-8
//! character or a `\r\n`), the `data` payload of each complete event out. Comment lines
//! (`: keep-alive`) and other fields are ignored; multi-line data is joined with `\n`.

#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
    data: Option<String>,
}

impl SseParser {
    /// Feeds bytes; returns the data of every event they complete.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut events = Vec::new();
        while let Some(end) = self.buf.iter().position(|&b| b == b'\n') {
            let mut line: Vec<u8> = self.buf.drain(..=end).collect();
            line.pop();
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            self.line(&String::from_utf8_lossy(&line), &mut events);
        }
        events
    }

    /// Data of an event the stream ended without a blank line after.
    pub fn finish(&mut self) -> Option<String> {
        if !self.buf.is_empty() {
            let rest = std::mem::take(&mut self.buf);
            let mut events = Vec::new();
            self.line(&String::from_utf8_lossy(&rest), &mut events);
        }
        self.data.take()
    }

    fn line(&mut self, line: &str, events: &mut Vec<String>) {
        if line.is_empty() {
            if let Some(data) = self.data.take() {
                events.push(data);
            }
            return;
        }
        if line.starts_with(':') {
            return;
        }
        let (field, value) = line.split_once(':').unwrap_or((line, ""));
        if field == "data" {
            let value = value.strip_prefix(' ').unwrap_or(value);
            match &mut self.data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(value);
                }
                None => self.data = Some(value.to_owned()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_anywhere_come_out_whole() {
        let stream = "data: {\"a\":1}\n\n: keep-alive\n\nevent: x\r\ndata: é\r\ndata: two\r\n\r\ndata: [DONE]\n\n";
        let bytes = stream.as_bytes();
        for split in 0..bytes.len() {
            let mut p = SseParser::default();
            let mut got = p.push(&bytes[..split]);
            got.extend(p.push(&bytes[split..]));
            assert_eq!(got, vec!["{\"a\":1}", "é\ntwo", "[DONE]"], "split at {split}");
            assert_eq!(p.finish(), None);
        }
    }

    #[test]
    fn unterminated_last_event_is_kept() {
        let mut p = SseParser::default();
        assert!(p.push(b"data: tail").is_empty());
        assert_eq!(p.finish().as_deref(), Some("tail"));
    }
}
