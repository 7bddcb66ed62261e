//! KV elements as little-endian bytes: how cache blocks leave a backend's memory and come back
//! (a saved prefix cache). Copying never computes on a value, so NaN bits survive.

/// An element that crosses the cache's edge as little-endian bytes.
pub(crate) trait LeBytes: Copy {
    const SIZE: usize;
    fn put(self, out: &mut [u8]);
    fn get(bytes: &[u8]) -> Self;
}

macro_rules! le_bytes {
    ($($t:ty),*) => {$(
        impl LeBytes for $t {
            const SIZE: usize = size_of::<$t>();
            fn put(self, out: &mut [u8]) {
                out.copy_from_slice(&self.to_le_bytes());
            }
            fn get(bytes: &[u8]) -> Self {
                <$t>::from_le_bytes(bytes.try_into().expect("SIZE bytes"))
            }
        }
    )*};
}

le_bytes!(f32, half::f16, u8);

/// Copies `src` into the front of `out` as little-endian bytes; returns the rest of `out`.
pub(crate) fn put_all<'a, T: LeBytes>(src: &[T], out: &'a mut [u8]) -> &'a mut [u8] {
    let (head, rest) = out.split_at_mut(src.len() * T::SIZE);
    for (x, o) in src.iter().zip(head.chunks_exact_mut(T::SIZE)) {
        x.put(o);
    }
    rest
}

/// Fills `dst` from the front of `data`; returns the rest of `data`.
pub(crate) fn get_all<'a, T: LeBytes>(dst: &mut [T], data: &'a [u8]) -> &'a [u8] {
    let (head, rest) = data.split_at(dst.len() * T::SIZE);
    for (x, d) in dst.iter_mut().zip(head.chunks_exact(T::SIZE)) {
        *x = T::get(d);
    }
    rest
}
