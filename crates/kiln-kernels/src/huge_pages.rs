//! Transparent huge pages for the large, long-lived buffers the kernels stream (repacked
//! weights, the KV cache).
//!
//! Linux distributions commonly set THP to `madvise`, so anonymous memory gets 4 KiB pages
//! unless asked: a 250 MB weight set then spans 60,000 pages, and every decode step walks all of
//! them (TLB misses; hardware prefetchers stop at each 4 KiB boundary). [`advise`] asks for
//! huge pages on the 2 MiB-aligned part of a buffer: `MADV_HUGEPAGE` (pages faulted later are
//! huge) and, for memory already written, `MADV_COLLAPSE` (Linux 6.1+: collapse now). Both are
//! hints: any error (an older kernel, THP `never`, no free huge page) leaves the buffer as it
//! was, and its contents never change.

/// 2 MiB, the x86-64 and common arm64 huge page size.
const HUGE_PAGE: usize = 2 << 20;

/// Asks the kernel to back the whole huge pages inside `buf` with huge pages (a no-op for
/// buffers under 2 MiB and off Linux). `collapse` also moves already-written pages now.
pub fn advise<T>(buf: &[T], collapse: bool) {
    #[cfg(target_os = "linux")]
    {
        let start = buf.as_ptr() as usize;
        let end = start + size_of_val(buf);
        let first = start.next_multiple_of(HUGE_PAGE);
        let last = end / HUGE_PAGE * HUGE_PAGE;
        if last <= first {
            return;
        }
        let (addr, len) = (first as *mut libc::c_void, last - first);
        // SAFETY: `addr..addr + len` lies within `buf`'s live allocation (rounded inwards to
        // page boundaries); MADV_HUGEPAGE and MADV_COLLAPSE only change how the pages are
        // backed, never their contents, and failures are ignored (the advice is optional).
        unsafe {
            libc::madvise(addr, len, libc::MADV_HUGEPAGE);
            if collapse {
                libc::madvise(addr, len, libc::MADV_COLLAPSE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (buf, collapse, HUGE_PAGE);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advice_never_changes_contents() {
        let data: Vec<u64> = (0..(5 << 20) / 8).map(|i| i * 2_654_435_761).collect();
        let copy = data.clone();
        advise(&data, true);
        advise(&data[3..100], true);
        advise::<u64>(&[], false);
        assert_eq!(data, copy);
    }
}
