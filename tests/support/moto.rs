//! An S3-compatible store for the tests: `moto` in server mode (PyPI's `moto[server]`,
//! installed by `scripts/test-setup.sh`), on a free loopback port, killed when dropped.
//! It takes any credentials; postie signs its requests all the same.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A running `moto_server`.
pub struct Moto {
    child: Child,
    port: u16,
    http: reqwest::Client,
}

impl Moto {
    /// Starts one and waits until it answers.
    pub async fn start() -> Self {
        Self::start_with(&[]).await
    }

    /// Starts one that, after `actions` requests of the test's (its own readiness
    /// probe is one more), checks credentials as S3 does: an access key it does not
    /// know gets 403 `InvalidAccessKeyId`.
    pub async fn start_checking_credentials_after(actions: u32) -> Self {
        let actions = (actions + 1).to_string();
        Self::start_with(&[("INITIAL_NO_AUTH_ACTION_COUNT", &actions)]).await
    }

    async fn start_with(env: &[(&str, &str)]) -> Self {
        let port = super::free_port();
        let child = Command::new("moto_server")
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("moto_server (pip install 'moto[server]'; scripts/test-setup.sh does)");
        let moto = Self {
            child,
            port,
            http: reqwest::Client::new(),
        };
        let url = moto.endpoint();
        super::eventually("moto_server to answer", Duration::from_secs(60), || {
            let url = url.clone();
            let http = moto.http.clone();
            async move { http.get(&url).send().await.ok().map(|_| ()) }
        })
        .await;
        moto
    }

    /// Its base URL (`attachments.s3.endpoint`).
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Creates `bucket`.
    pub async fn bucket(&self, bucket: &str) {
        let reply = self
            .http
            .put(format!("{}/{bucket}", self.endpoint()))
            .send()
            .await
            .expect("moto");
        assert!(reply.status().is_success(), "creating {bucket}: {reply:?}");
    }

    /// Stores `bytes` at `bucket`/`key`.
    pub async fn put(&self, bucket: &str, key: &str, bytes: Vec<u8>) {
        let reply = self
            .http
            .put(format!("{}/{bucket}/{key}", self.endpoint()))
            .header("content-type", "application/octet-stream")
            .body(bytes)
            .send()
            .await
            .expect("moto");
        assert!(reply.status().is_success(), "putting {key}: {reply:?}");
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
