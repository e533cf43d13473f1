//! The request's two phases as one future that holds one phase at a time: the checks before
//! the store, then the trip through the store and the handler.
//!
//! Written as one `async` block, the flow's future kept room for the checks' state (the
//! request as given, the body being read) while it waited for the store and the handler: an
//! `async` block keeps what it captured, and the locals moved out of, for its whole life.
//! [`Then`] drops the first phase before it builds the second, so a request waiting for the
//! store holds only what that wait needs (about 0.8 KiB less per request in flight).
//!
//! `futures_util`'s `FutureExt::then` is the same combinator; it is written here because the
//! default build (`sqlite` alone) does not otherwise depend on `futures-util`.

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use pin_project_lite::pin_project;

pin_project! {
    /// Runs `first`, then the future `next` makes of its output.
    #[project = ThenProj]
    #[project_replace = ThenReplace]
    pub(super) enum Then<F, N, G> {
        First { #[pin] first: F, next: N },
        Second { #[pin] second: G },
        // Only between the two, while `next` runs.
        Between,
    }
}

/// `first`, then `next(output)`.
pub(super) fn then<F, N, G>(first: F, next: N) -> Then<F, N, G>
where
    F: Future,
    N: FnOnce(F::Output) -> G,
    G: Future,
{
    Then::First { first, next }
}

impl<F, N, G> Future for Then<F, N, G>
where
    F: Future,
    N: FnOnce(F::Output) -> G,
    G: Future,
{
    type Output = G::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<G::Output> {
        loop {
            match self.as_mut().project() {
                ThenProj::First { first, .. } => {
                    let output = ready!(first.poll(cx));
                    if let ThenReplace::First { next, .. } =
                        self.as_mut().project_replace(Then::Between)
                    {
                        self.set(Then::Second {
                            second: next(output),
                        });
                    }
                }
                ThenProj::Second { second } => return second.poll(cx),
                // Never polled there: `next` cannot poll this future.
                ThenProj::Between => return Poll::Pending,
            }
        }
    }
}

pin_project! {
    /// The second phase: an answer already made (a rejection), or the trip through the
    /// store, traced in the request's span or not.
    #[project = SecondProj]
    pub(super) enum Second<T, E> {
        Answered { answer: Option<T> },
        Plain { #[pin] execute: E },
        Traced { #[pin] execute: tracing::instrument::Instrumented<E> },
    }
}

impl<T, E: Future<Output = T>> Future for Second<T, E> {
    type Output = T;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        match self.project() {
            // Answered once; never polled again after that (the flow is then over).
            SecondProj::Answered { answer } => match answer.take() {
                Some(answer) => Poll::Ready(answer),
                None => Poll::Pending,
            },
            SecondProj::Plain { execute } => execute.poll(cx),
            SecondProj::Traced { execute } => execute.poll(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn runs_the_first_then_the_second_made_of_its_output() {
        let both = then(async { 20 }, |n| async move { n + 1 });
        assert_eq!(both.await, 21);
    }

    #[tokio::test]
    async fn waits_for_each_phase() {
        let (tx1, rx1) = tokio::sync::oneshot::channel::<u8>();
        let (tx2, rx2) = tokio::sync::oneshot::channel::<u8>();
        let both = tokio::spawn(then(rx1, move |first| async move {
            first.expect("first") + rx2.await.expect("second")
        }));
        tokio::task::yield_now().await;
        tx1.send(2).expect("send");
        tokio::task::yield_now().await;
        tx2.send(3).expect("send");
        assert_eq!(both.await.expect("join"), 5);
    }
}
