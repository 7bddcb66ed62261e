//! The shape of a token tree (`speculative_token_tree`, vLLM's spelling): a list of paths, each
//! a tuple of child ranks from the root, e.g. `[(0,), (1,), (0, 0), (0, 1), (1, 0)]`: the best
//! and second-best next token, the best two after the best, and the best after the second.
//! Each path's parent path (all but its last rank) must be in the list too.
//!
//! Nodes are kept in breadth-first order (by depth, then ranks), so every node comes after its
//! parent; a proposer fills the shape with the candidates it finds and leaves out a node whose
//! rank it has no candidate for, with its subtree.

/// Most child rank a path may name (candidates beyond are rarely worth verifying).
pub const MAX_TREE_RANK: usize = 15;

/// A validated token-tree shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenTree {
    /// Each node's rank among its parent's candidates (0: the best).
    pub ranks: Vec<usize>,
    /// Each node's parent: an earlier node, or `u32::MAX` for the root.
    pub parents: Vec<u32>,
    /// The longest path, in nodes.
    pub depth: usize,
}

impl TokenTree {
    /// Parses a Python-literal list of tuples (`"[(0,), (0, 0)]"`) or a JSON array of arrays
    /// (`[[0], [0, 0]]`, given as the text of one). Errors say what is wrong, in words.
    pub fn parse(text: &str, max_nodes: usize) -> Result<Self, String> {
        let mut paths = parse_paths(text)?;
        if paths.is_empty() {
            return Err("must list at least one path, e.g. \"[(0,), (1,)]\"".into());
        }
        if paths.len() > max_nodes {
            return Err(format!("has {} nodes; at most {max_nodes}", paths.len()));
        }
        paths.sort_by(|a, b| a.len().cmp(&b.len()).then_with(|| a.cmp(b)));
        if let Some(i) = paths.windows(2).position(|w| w[0] == w[1]) {
            return Err(format!("lists the path {} twice", show(&paths[i])));
        }
        let mut tree = Self { ranks: Vec::new(), parents: Vec::new(), depth: 0 };
        for (i, path) in paths.iter().enumerate() {
            let (&rank, parent_path) = path.split_last().ok_or("has an empty path ()")?;
            if rank > MAX_TREE_RANK {
                return Err(format!(
                    "path {} has rank {rank}; at most {MAX_TREE_RANK}",
                    show(path)
                ));
            }
            let parent = if parent_path.is_empty() {
                u32::MAX
            } else {
                let Some(p) = paths[..i].iter().position(|q| q == parent_path) else {
                    return Err(format!(
                        "path {} has no parent {} in the list",
                        show(path),
                        show(parent_path)
                    ));
                };
                p as u32
            };
            tree.ranks.push(rank);
            tree.parents.push(parent);
            tree.depth = tree.depth.max(path.len());
        }
        Ok(tree)
    }

    pub fn num_nodes(&self) -> usize {
        self.ranks.len()
    }

    /// Whether the shape is one chain of best candidates (`(0,), (0, 0), ...`): plain drafting.
    pub fn is_chain(&self) -> bool {
        self.ranks.iter().all(|&r| r == 0) && self.depth == self.num_nodes()
    }
}

fn show(path: &[usize]) -> String {
    match path {
        [one] => format!("({one},)"),
        _ => format!("({})", path.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")),
    }
}

/// `[(a, b), (c,)]` or `[[a, b], [c]]`: paths of non-negative integers (a one-rank path in
/// parentheses needs its comma, `(0,)`, as in Python). Whitespace may sit between tokens only.
fn parse_paths(text: &str) -> Result<Vec<Vec<usize>>, String> {
    let bad = |what: &str| {
        format!("is not a list of tuples of ranks ({what}), e.g. \"[(0,), (1,), (0, 0)]\"")
    };
    let mut chars = text.chars().peekable();
    if next(&mut chars) != Some('[') {
        return Err(bad("no opening ["));
    }
    let mut paths = Vec::new();
    loop {
        let (open, close) = match next(&mut chars) {
            Some(']') => break,
            Some('(') => ('(', ')'),
            Some('[') => ('[', ']'),
            _ => return Err(bad("expected a tuple")),
        };
        let (mut path, mut trailing_comma) = (Vec::new(), false);
        loop {
            skip_whitespace(&mut chars);
            let mut digits = String::new();
            while let Some(c) = chars.next_if(char::is_ascii_digit) {
                digits.push(c);
            }
            if !digits.is_empty() {
                path.push(digits.parse::<usize>().map_err(|_| bad("a rank too large"))?);
            }
            match next(&mut chars) {
                Some(',') if !digits.is_empty() => trailing_comma = true,
                Some(c) if c == close => break,
                _ => return Err(bad("expected a rank, a comma or the tuple's end")),
            }
        }
        if open == '(' && path.len() == 1 && !trailing_comma {
            return Err(bad("(r) is a number in Python; a one-rank path is (r,)"));
        }
        paths.push(path);
        match next(&mut chars) {
            Some(',') => {}
            Some(']') => break,
            _ => return Err(bad("expected a comma or ]")),
        }
    }
    if next(&mut chars).is_some() {
        return Err(bad("text after the closing ]"));
    }
    Ok(paths)
}

/// The next character that is not whitespace.
fn next(chars: &mut std::iter::Peekable<std::str::Chars<'_>>) -> Option<char> {
    skip_whitespace(chars);
    chars.next()
}

fn skip_whitespace(chars: &mut std::iter::Peekable<std::str::Chars<'_>>) {
    while chars.next_if(|c| c.is_whitespace()).is_some() {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_become_nodes_in_breadth_first_order() {
        let t = TokenTree::parse("[(0, 0), (1,), (0,), (0, 1), (1, 0), (0, 0, 0)]", 32).unwrap();
        // Sorted: (0,) (1,) (0,0) (0,1) (1,0) (0,0,0).
        assert_eq!(t.ranks, [0, 1, 0, 1, 0, 0]);
        assert_eq!(t.parents, [u32::MAX, u32::MAX, 0, 0, 1, 2]);
        assert_eq!(t.depth, 3);
        assert!(!t.is_chain());
        let json = TokenTree::parse(" [ [0] , [1], [ 0,0 ] ] ", 32).unwrap();
        assert_eq!(json.parents, [u32::MAX, u32::MAX, 0]);
        assert!(TokenTree::parse("[(0,), (0,0), (0,0,0)]", 32).unwrap().is_chain());
    }

    #[test]
    fn malformed_shapes_are_refused_in_words() {
        let err = |text: &str| TokenTree::parse(text, 4).unwrap_err();
        assert!(err("[(0, 0)]").contains("no parent (0,)"), "{}", err("[(0, 0)]"));
        assert!(err("[(0,), (0,)]").contains("twice"));
        assert!(err("[]").contains("at least one"));
        assert!(err("[(0,), (1,), (2,), (3,), (4,)]").contains("at most 4"));
        assert!(err("[(16,)]").contains("rank 16"));
        assert!(err("[()]").contains("empty path"));
        let bad_texts = [
            "(0,)",
            "[(0,)",
            "[(0,) (1,)]",
            "[(-1,)]",
            "[(0,),]x",
            "[(a,)]",
            "[(0,,)]",
            "[(1 0,)]",
            "[(0)]",
        ];
        for bad in bad_texts {
            assert!(err(bad).contains("list of tuples"), "{bad}: {}", err(bad));
        }
    }
}
