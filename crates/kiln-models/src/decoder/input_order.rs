//! Permuted inputs: a matrix stored with its columns in another order than its input's
//! (act-order GPTQ, its columns sorted by group at load) reads its input permuted to match, so
//! `W · x = W_sorted · x[order]`. Matrices that read one input (q/k/v, gate/up) run in one
//! dispatch when they share their order (as GPTQ gives them: it orders a layer's inputs by the
//! statistics of that shared input), else one dispatch each.

use kiln_backend::{Backend, LinearJob};

/// Column `j` of a matrix is input `order[j]`; `None`: the input's own order.
pub(crate) type InputOrder = Option<Vec<usize>>;

/// The input orders of `N` matrices that read one input.
pub(crate) struct InputOrders<const N: usize> {
    orders: [InputOrder; N],
    /// All `N` orders are the same.
    shared: bool,
}

impl<const N: usize> InputOrders<N> {
    pub(crate) fn new(orders: [InputOrder; N]) -> Self {
        let shared = orders.iter().all(|o| o == &orders[0]);
        Self { orders, shared }
    }

    /// The widest permuted input (0 when none is permuted): the scratch a token needs.
    pub(crate) fn width(&self) -> usize {
        self.orders.iter().flatten().map(Vec::len).max().unwrap_or(0)
    }

    /// [`Backend::linear`] of `jobs` (matrix `j`'s is job `j`) over `x` (`[n, k]`), each
    /// reading `x` permuted by its order into `scratch`.
    pub(crate) fn linear<B: Backend>(
        &self,
        be: &B,
        (x, n): (B::View<'_>, usize),
        scratch: &mut B::Buffer,
        jobs: &mut [LinearJob<'_, B>; N],
    ) {
        if self.shared {
            return permuted_linear(be, self.orders[0].as_deref(), (x, n), scratch, jobs);
        }
        for (job, order) in jobs.iter_mut().zip(&self.orders) {
            let job = std::slice::from_mut(job);
            permuted_linear(be, order.as_deref(), (x, n), scratch, job);
        }
    }
}

/// [`Backend::linear`] of `jobs` over `x` (`[n, k]`), or with an order, over `x` permuted
/// into `scratch`.
fn permuted_linear<B: Backend>(
    be: &B,
    order: Option<&[usize]>,
    (x, n): (B::View<'_>, usize),
    scratch: &mut B::Buffer,
    jobs: &mut [LinearJob<'_, B>],
) {
    let Some(order) = order else { return be.linear(x, n, jobs) };
    let len = n * order.len();
    be.permute_cols(x, n, order, B::view_mut(scratch, 0..len));
    be.linear(B::view(scratch, 0..len), n, jobs);
}
