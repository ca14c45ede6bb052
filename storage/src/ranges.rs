//! Planning of multi-range reads: which requests to send for a set of ranges.
//!
//! Object stores charge per request and a request has a fixed latency of tens of
//! milliseconds, so ranges that lie close together are cheaper to fetch as one
//! request and split locally. The gap that is worth reading through and the largest
//! merged request are settings ([`StoreConfig`](crate::StoreConfig)).

use std::ops::Range;

/// One request of a multi-range read and which of the caller's ranges it serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Fetch {
    /// Byte range fetched with one request.
    pub(crate) range: Range<u64>,
    /// Indices into the caller's ranges that lie inside `range`.
    pub(crate) members: Vec<usize>,
}

/// Groups `ranges` (any order, overlaps allowed, none empty) into requests: sorted
/// by start, a range joins the current request when it begins at most `gap` bytes
/// after the request's end and the merged request stays within `max_bytes` (a single
/// range longer than `max_bytes` is still one request).
pub(crate) fn coalesce(ranges: &[Range<u64>], gap: u64, max_bytes: u64) -> Vec<Fetch> {
    let mut order: Vec<usize> = (0..ranges.len()).collect();
    order.sort_by_key(|&i| (ranges[i].start, ranges[i].end));

    let mut fetches: Vec<Fetch> = Vec::new();
    for i in order {
        let r = &ranges[i];
        if let Some(last) = fetches.last_mut() {
            let merged_end = last.range.end.max(r.end);
            let close = r.start <= last.range.end.saturating_add(gap);
            if close && merged_end - last.range.start <= max_bytes {
                last.range.end = merged_end;
                last.members.push(i);
                continue;
            }
        }
        fetches.push(Fetch {
            range: r.clone(),
            members: vec![i],
        });
    }
    fetches
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adjacent_and_near_ranges_merge() {
        let fetches = coalesce(&[0..10, 12..20, 100..110], 5, u64::MAX);
        assert_eq!(fetches.len(), 2);
        assert_eq!(fetches[0].range, 0..20);
        assert_eq!(fetches[0].members, vec![0, 1]);
        assert_eq!(fetches[1].range, 100..110);
    }

    #[test]
    fn unsorted_and_overlapping_ranges_keep_their_indices() {
        let fetches = coalesce(&[50..60, 0..10, 5..55], 0, u64::MAX);
        assert_eq!(fetches.len(), 1);
        assert_eq!(fetches[0].range, 0..60);
        assert_eq!(fetches[0].members, vec![1, 2, 0]);
    }

    #[test]
    fn merged_requests_respect_the_size_cap() {
        let fetches = coalesce(&[0..10, 10..20, 20..30], 0, 20);
        assert_eq!(
            fetches.iter().map(|f| f.range.clone()).collect::<Vec<_>>(),
            vec![0..20, 20..30]
        );
        // A single range larger than the cap is still fetched whole.
        let single = [Range { start: 0, end: 100 }];
        let fetches = coalesce(&single, 0, 20);
        assert_eq!(fetches[0].range, 0..100);
    }

    #[test]
    fn far_ranges_stay_apart() {
        let fetches = coalesce(&[0..1, 1000..1001], 10, u64::MAX);
        assert_eq!(fetches.len(), 2);
    }
}
