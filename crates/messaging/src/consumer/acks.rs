//! Acking, in exactly one place: a delivery cannot be acked twice, nor before its outcome is
//! durable.

use std::{collections::BTreeSet, sync::Arc};

use lapin::{message::Delivery, options::BasicAckOptions};

use crate::publisher::PublishError;

/// A delivery not yet settled, and its channel's [`Acks`]. Its only ways out consume it, so it is
/// settled at most once.
pub(super) struct InFlight {
    delivery: Delivery,
    acks: Arc<Acks>,
}

impl InFlight {
    /// A delivery [`Acks::received`] has recorded.
    fn new(delivery: Delivery, acks: Arc<Acks>) -> Self {
        Self { delivery, acks }
    }

    /// The delivery itself.
    pub(super) fn delivery(&self) -> &Delivery {
        &self.delivery
    }

    /// Ack: the outcome (commit, retry copy, parked copy) is already durable.
    pub(super) async fn ack(self) -> Result<(), PublishError> {
        self.acks.ack(self.delivery.delivery_tag).await?;
        Ok(())
    }

    /// Ack a batch, all from one channel, after its one commit.
    pub(super) async fn ack_all(batch: Vec<Self>) -> Result<(), PublishError> {
        let Some(first) = batch.first() else { return Ok(()) };
        let acks = Arc::clone(&first.acks);
        let tags: Vec<u64> = batch.iter().map(|member| member.delivery.delivery_tag).collect();
        acks.ack_all(&tags).await?;
        Ok(())
    }
}

/// The deliveries of one channel that are not yet settled. Every ack of the channel goes through
/// here, in order, so that a batch is settled with one `basic.ack(multiple)` only when that
/// settles exactly its own deliveries: when no delivery with a smaller tag is still unsettled.
/// (The tags of a channel grow in the order its deliveries arrive, and each is recorded here
/// before it is handled; the work channel has one consumer, so none can arrive out of order.)
/// Otherwise, it acks each of its deliveries.
pub(super) struct Acks {
    pub(super) channel: lapin::Channel,
    unsettled: tokio::sync::Mutex<BTreeSet<u64>>,
}

impl Acks {
    pub(super) fn new(channel: lapin::Channel) -> Arc<Self> {
        Arc::new(Self { channel, unsettled: tokio::sync::Mutex::default() })
    }

    /// A delivery arrived: from now on it is in flight.
    pub(super) async fn received(self: &Arc<Self>, delivery: Delivery) -> InFlight {
        self.unsettled.lock().await.insert(delivery.delivery_tag);
        InFlight::new(delivery, Arc::clone(self))
    }

    /// Ack one delivery.
    async fn ack(&self, tag: u64) -> lapin::Result<()> {
        let mut unsettled = self.unsettled.lock().await;
        self.channel.basic_ack(tag, BasicAckOptions::default()).await?;
        unsettled.remove(&tag);
        Ok(())
    }

    /// Ack these deliveries: with one `multiple` ack if nothing before the last is unsettled.
    async fn ack_all(&self, tags: &[u64]) -> lapin::Result<()> {
        let Some(&last) = tags.iter().max() else { return Ok(()) };
        let mut unsettled = self.unsettled.lock().await;
        for tag in tags {
            unsettled.remove(tag);
        }
        if unsettled.range(..last).next().is_none() {
            return self.channel.basic_ack(last, BasicAckOptions { multiple: true }).await;
        }
        for &tag in tags {
            self.channel.basic_ack(tag, BasicAckOptions::default()).await?;
        }
        Ok(())
    }
}
