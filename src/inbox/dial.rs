//! One way to open a PostgreSQL connection outside a pool, TLS as `sslmode` says:
//! the inbox's dedicated connections (the maintenance lock holder) and the
//! producers' outbox databases (`outbox`), whose relay also listens for
//! notifications on a connection of its own.

use futures_util::StreamExt;
use tokio::sync::mpsc;
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::{AsyncMessage, Client, NoTls, Socket};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::tls::tls_config;
use super::DbError;
use crate::config::{DatabaseSettings, DbPlan, DbTls};

/// How to connect to one database; cheap to clone.
#[derive(Clone)]
pub(crate) struct Dialer {
    config: tokio_postgres::Config,
    tls: Option<MakeRustlsConnect>,
}

impl Dialer {
    /// From a parsed URL: `database.connect_timeout` on each connect, TLS verified
    /// against `database.ca_file` (and the system's roots).
    pub(crate) fn new(
        plan: &DbPlan,
        settings: &DatabaseSettings,
        application: &str,
    ) -> anyhow::Result<Self> {
        let mut config = plan.config.clone();
        config.connect_timeout(settings.connect_timeout);
        config.application_name(application);
        let tls = match plan.tls {
            DbTls::Off => None,
            tls => Some(MakeRustlsConnect::new(tls_config(tls, settings.ca_file())?)),
        };
        Ok(Self { config, tls })
    }

    /// The connection settings (for a pool).
    pub(super) fn parts(&self) -> (&tokio_postgres::Config, Option<&MakeRustlsConnect>) {
        (&self.config, self.tls.as_ref())
    }

    /// A connection; its driver runs until the client is dropped or the server goes.
    pub(crate) async fn connect(&self) -> Result<Client, DbError> {
        self.open(None).await
    }

    /// A connection whose notifications each put a token into `wake` (capacity 1:
    /// many notifications before a look are one); when the connection ends, `wake`'s
    /// sender is dropped, so its receiver sees `None`.
    pub(crate) async fn connect_listening(
        &self,
        wake: mpsc::Sender<()>,
    ) -> Result<Client, DbError> {
        self.open(Some(wake)).await
    }

    async fn open(&self, wake: Option<mpsc::Sender<()>>) -> Result<Client, DbError> {
        match &self.tls {
            None => drive(&self.config, NoTls, wake).await,
            Some(tls) => drive(&self.config, tls.clone(), wake).await,
        }
    }
}

/// Connects and spawns the connection's driver.
async fn drive<T>(
    config: &tokio_postgres::Config,
    tls: T,
    wake: Option<mpsc::Sender<()>>,
) -> Result<Client, DbError>
where
    T: MakeTlsConnect<Socket> + Send,
    T::Stream: Send + 'static,
    T::TlsConnect: Send,
    <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
{
    let (client, mut connection) = config.connect(tls).await?;
    match wake {
        None => {
            tokio::spawn(connection);
        }
        Some(wake) => {
            tokio::spawn(async move {
                let mut messages =
                    futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
                while let Some(Ok(message)) = messages.next().await {
                    if let AsyncMessage::Notification(_) = message {
                        let _ = wake.try_send(());
                    }
                }
            });
        }
    }
    Ok(client)
}
