//! A publisher with publisher confirms, where a broker `nack` or a `mandatory` return is an error,
//! never a success. Sends can be pipelined: [`Publisher::send`] puts a message on the wire and
//! returns its pending confirm, so a batch costs one round trip instead of one per message.

use lapin::{
    BasicProperties, Channel, Confirmation, Connection, PublisherConfirm,
    options::{BasicPublishOptions, ConfirmSelectOptions},
};

/// Why a message was not accepted by the broker.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// `mandatory` and no queue is bound for it: it went nowhere.
    #[error("unroutable: returned by the broker ({0})")]
    Returned(String),
    /// The broker refused to take responsibility for it (e.g. a queue at its limit).
    #[error("nacked by the broker")]
    Nacked,
    /// The channel or connection failed: whether the message arrived is unknown.
    #[error("broker connection: {0}")]
    Connection(#[from] lapin::Error),
}

impl PublishError {
    /// Whether the channel is unusable and must be reopened (as opposed to a refusal of one
    /// message on a healthy channel).
    pub fn is_connection(&self) -> bool {
        matches!(self, Self::Connection(_))
    }
}

/// A channel in confirm mode.
#[derive(Clone)]
pub struct Publisher {
    channel: Channel,
}

impl Publisher {
    /// Open a channel on `connection` and put it in confirm mode.
    pub async fn open(connection: &Connection) -> lapin::Result<Self> {
        let channel = connection.create_channel().await?;
        channel.confirm_select(ConfirmSelectOptions::default()).await?;
        Ok(Self { channel })
    }

    /// The underlying channel (for declarations).
    pub fn channel(&self) -> &Channel {
        &self.channel
    }

    /// Publish and wait for the broker's confirm.
    pub async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        payload: &[u8],
        properties: BasicProperties,
    ) -> Result<(), PublishError> {
        self.send(exchange, routing_key, payload, properties).await?.confirmed().await
    }

    /// Put a message on the wire (mandatory) without waiting; await the returned [`Pending`] to
    /// learn whether the broker took it.
    pub async fn send(
        &self,
        exchange: &str,
        routing_key: &str,
        payload: &[u8],
        properties: BasicProperties,
    ) -> Result<Pending, PublishError> {
        let confirm = self
            .channel
            .basic_publish(
                exchange.into(),
                routing_key.into(),
                BasicPublishOptions { mandatory: true, ..BasicPublishOptions::default() },
                payload,
                properties,
            )
            .await?;
        Ok(Pending(confirm))
    }

    /// Close the channel politely (after every confirm has been awaited).
    pub async fn close(&self) {
        let _ = self.channel.close(200, "bye".into()).await;
    }
}

/// A sent message whose confirm has not arrived yet. Dropping it forgets the outcome, so the
/// type is `must_use`: a fire-and-forget publish is exactly what this module exists to prevent.
#[must_use = "a publish is only safe once its confirm has been awaited"]
pub struct Pending(PublisherConfirm);

impl Pending {
    /// Wait for the confirm; a return (unroutable) or a nack is an error.
    pub async fn confirmed(self) -> Result<(), PublishError> {
        match self.0.await? {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(returned)) | Confirmation::Nack(Some(returned)) => {
                Err(PublishError::Returned(format!("{} {}", returned.reply_code, returned.reply_text)))
            }
            Confirmation::Nack(None) => Err(PublishError::Nacked),
            // Only reachable if confirm mode was never enabled: treat as "not known to be stored".
            Confirmation::NotRequested => Err(PublishError::Nacked),
        }
    }
}
