//! Versions as the tree they form: each under its parent, branches drawn
//! (`crabctl versions`).

use std::collections::{BTreeMap, BTreeSet};

/// The order in which to print versions given as `(version, parent)`, and
/// the prefix that draws each one's branch: depth first, children by
/// number. A version whose parent is gone (removed) or unknown is a root.
pub fn layout(versions: &[(u64, Option<u64>)]) -> Vec<(u64, String)> {
    let known: BTreeSet<u64> = versions.iter().map(|(v, _)| *v).collect();
    let mut children: BTreeMap<Option<u64>, Vec<u64>> = BTreeMap::new();
    for (v, parent) in versions {
        let parent = parent.filter(|p| known.contains(p) && p < v);
        children.entry(parent).or_default().push(*v);
    }
    for list in children.values_mut() {
        list.sort_unstable();
    }
    let mut out = Vec::with_capacity(versions.len());
    // (version, the bars of its ancestors, whether it is the last child).
    let mut stack: Vec<(u64, String, Option<bool>)> = children
        .get(&None)
        .map(|roots| roots.iter().rev().map(|v| (*v, String::new(), None)).collect())
        .unwrap_or_default();
    while let Some((v, bars, last)) = stack.pop() {
        let (prefix, below) = match last {
            None => (String::new(), String::new()),
            Some(true) => (format!("{bars}└─"), format!("{bars}  ")),
            Some(false) => (format!("{bars}├─"), format!("{bars}│ ")),
        };
        out.push((v, prefix));
        if let Some(kids) = children.get(&Some(v)) {
            for (i, kid) in kids.iter().enumerate().rev() {
                stack.push((*kid, below.clone(), Some(i + 1 == kids.len())));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drawn(versions: &[(u64, Option<u64>)]) -> String {
        layout(versions)
            .into_iter()
            .map(|(v, p)| format!("{p}{v}\n"))
            .collect()
    }

    #[test]
    fn branches_are_drawn_under_their_parents() {
        // 1 ← 2; back to 1: 3; back to 2: 4 ← 5; 6 after a restart.
        let versions = [
            (1, None),
            (2, Some(1)),
            (3, Some(1)),
            (4, Some(2)),
            (5, Some(4)),
            (6, None),
        ];
        assert_eq!(drawn(&versions), "1\n├─2\n│ └─4\n│   └─5\n└─3\n6\n");
        // A line: no branches.
        assert_eq!(drawn(&[(1, None), (2, Some(1)), (3, Some(2))]), "1\n└─2\n  └─3\n");
        // A removed parent makes a root; so does a parent that is not older.
        assert_eq!(drawn(&[(2, Some(1)), (3, Some(2)), (4, Some(9))]), "2\n└─3\n4\n");
        assert_eq!(drawn(&[]), "");
    }
}
