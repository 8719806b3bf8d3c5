//! The session's publishing channel (publisher confirms on), shared by every
//! delivery's disposition and replaced when the broker closes it.
//!
//! A channel-level error (a publish to a missing exchange: 404; a precondition: 406)
//! closes the channel but not the connection. Without a replacement every later
//! publish would fail, and every delivery that needs a republish would sit unacked
//! while `/readyz` stays green. So a publish asks for the channel, and a closed one is
//! swapped for a new confirm channel on the same connection.

use std::sync::Arc;

use lapin::{BasicProperties, Channel, Connection};
use tokio::sync::Mutex;

use super::session::bounded;
use crate::broker::{self, PublishError};

/// The session's confirm channel; cheap to clone.
#[derive(Clone)]
pub(super) struct Publisher {
    conn: Arc<Connection>,
    channel: Arc<Mutex<Channel>>,
}

impl Publisher {
    /// Opens the first confirm channel on `conn`.
    pub(super) async fn open(conn: Arc<Connection>) -> Result<Self, lapin::Error> {
        let channel = broker::confirm_channel(&conn).await?;
        Ok(Self {
            conn,
            channel: Arc::new(Mutex::new(channel)),
        })
    }

    /// True while the session's connection stands: a failed publish is then worth a
    /// retry (on a new channel if the broker closed this one).
    pub(super) fn connection_stands(&self) -> bool {
        self.conn.status().connected()
    }

    /// The channel to publish on: the current one while it stands, else a new one.
    async fn channel(&self) -> Result<Channel, lapin::Error> {
        let mut current = self.channel.lock().await;
        if !current.status().connected() {
            let fresh = broker::confirm_channel(&self.conn).await?;
            tracing::warn!("the broker closed the publishing channel; publishing on a new one");
            *current = fresh;
        }
        Ok(current.clone())
    }

    /// [`broker::publish_confirmed`] on the current channel (replaced first if the
    /// broker closed it).
    pub(super) async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        mandatory: bool,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<(), PublishError> {
        let channel = self.channel().await?;
        broker::publish_confirmed(&channel, exchange, routing_key, mandatory, body, properties)
            .await
    }

    /// Closes the current channel (bounded).
    pub(super) async fn close(&self) {
        let channel = self.channel.lock().await.clone();
        bounded(channel.close(200, "done".into())).await;
    }
}
