//! Stop strings matched across token boundaries.
//!
//! Text arrives in pieces (one per token). The matcher releases text only when no stop string
//! can start in it: it holds back the shortest tail of the unreleased text that is a proper
//! prefix of some stop string. A match can therefore never begin in released text, and the
//! earliest match in the held text ends the output right before the stop string (which is not
//! returned, as in OpenAI's API). Cost per piece: `O(held * stops)` where `held` is below the
//! longest stop string plus the piece.

#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    /// The stop string that ended the text, once one did.
    matched: Option<String>,
}

/// What a piece of text released.
#[derive(Debug, PartialEq, Eq)]
pub struct Released {
    pub text: String,
    /// A stop string was found; `text` ends right before it.
    pub stopped: bool,
}

impl StopMatcher {
    /// Empty stop strings are ignored.
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            held: String::new(),
            matched: None,
        }
    }

    /// The stop string that ended the text (after a push that returned `stopped`).
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    /// Adds `piece`; returns what can be released now.
    pub fn push(&mut self, piece: &str) -> Released {
        self.held.push_str(piece);
        if self.stops.is_empty() {
            return Released { text: std::mem::take(&mut self.held), stopped: false };
        }
        let first_match = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|&(at, _)| at);
        if let Some((at, stop)) = first_match {
            self.matched = Some(stop.clone());
            let mut text = std::mem::take(&mut self.held);
            text.truncate(at);
            return Released { text, stopped: true };
        }
        let keep_from = self.partial_match_start();
        let rest = self.held.split_off(keep_from);
        Released { text: std::mem::replace(&mut self.held, rest), stopped: false }
    }

    /// Releases whatever is held (the sequence ended for another reason).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// The earliest char boundary from which the held text is a proper prefix of a stop.
    fn partial_match_start(&self) -> usize {
        let held = self.held.as_str();
        held.char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                self.stops.iter().any(|s| s.len() > held.len() - i && s.starts_with(&held[i..]))
            })
            .unwrap_or(held.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| (*s).to_owned()).collect();
        let mut m = StopMatcher::new(&stops);
        let mut out = String::new();
        for p in pieces {
            let r = m.push(p);
            out.push_str(&r.text);
            if r.stopped {
                return (out, true);
            }
        }
        out.push_str(&m.flush());
        (out, false)
    }

    #[test]
    fn matches_across_pieces_and_cuts_the_stop_string() {
        assert_eq!(run(&["STOP"], &["ab", "cS", "TO", "Pxyz"]), ("abc".into(), true));
        assert_eq!(run(&["\n\n"], &["a\n", "\nb"]), ("a".into(), true));
        assert_eq!(run(&["xyz", "b"], &["aab"]), ("aa".into(), true));
    }

    #[test]
    fn holds_back_only_possible_prefixes_and_flushes_the_rest() {
        let stops = vec!["END".to_owned()];
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.push("hello E"), Released { text: "hello ".into(), stopped: false });
        assert_eq!(m.push("x"), Released { text: "Ex".into(), stopped: false });
        assert_eq!(m.push("EN"), Released { text: String::new(), stopped: false });
        assert_eq!(m.flush(), "EN");
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
        assert_eq!(run(&["é!"], &["caf", "é", "?"]), ("café?".into(), false));
    }

    #[test]
    fn the_earliest_match_wins() {
        assert_eq!(run(&["cd", "abc"], &["xabcd"]), ("x".into(), true));
        let stops = vec!["cd".to_owned(), "abc".to_owned()];
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.matched(), None);
        assert!(m.push("xab").text == "x" && m.push("cd").stopped);
        assert_eq!(m.matched(), Some("abc"));
    }
}
