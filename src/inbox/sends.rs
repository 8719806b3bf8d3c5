//! The one count of recent sends (issue 47). `postie status` (the fleet's send rate,
//! each transport's sends, each lane's sends and lateness) and the console's overview
//! (the same transports, a chart of the last hour) read one statement over the sent
//! rows of the last hour, [`Inbox::recent_sends`], and take their views of it here
//! ([`RecentSends`]). Before, they ran four queries of their own, three of them for
//! `postie status`.
//!
//! Two counts are kept apart on purpose. The reputation rates (`reputation.rs`) count
//! sends per job type over a day, longer than a sent row may be kept
//! (`inbox.retention`), so every send is also added to `postie_send_tally`, a counter
//! per minute and type. And the send-rate limiter (`work::limiter`) counts only its
//! own instance's sends of the last second, in memory, for its adaptive cap: a
//! statement per send would cost more than the sends it paces.

use super::{DbError, Inbox};

/// The sent rows of the last hour, grouped by minute, transport, lane and whether
/// they are of the last 60 s; and again by lane alone (`GROUPING SETS`), for each
/// lane's lateness percentiles over the last 60 s (percentiles do not add up).
/// `updated_at` bounds the scan to the finished rows' index: a sent row's
/// `updated_at` is its `sent_at`.
const RECENT_SENDS: &str = "WITH s AS (
  SELECT (extract(epoch FROM date_trunc('minute', now()) - date_trunc('minute', sent_at))
          / 60)::bigint AS ago,
         provider, lane, sent_at > now() - interval '60 seconds' AS recent,
         extract(epoch FROM sent_at - due_at)::float8 AS late
    FROM postie_inbox
   WHERE status = 'sent' AND updated_at > now() - interval '1 hour'
     AND sent_at > now() - interval '1 hour')
SELECT GROUPING(ago, provider) = 3 AS per_lane, ago, provider, lane, recent, count(*),
       coalesce(sum(late), 0), count(late),
       percentile_cont(0.5) WITHIN GROUP (ORDER BY late) FILTER (WHERE recent),
       percentile_cont(0.99) WITHIN GROUP (ORDER BY late) FILTER (WHERE recent)
  FROM s
 GROUP BY GROUPING SETS ((ago, provider, lane, recent), (lane, recent))";

/// One group of [`RECENT_SENDS`].
#[derive(Debug, Clone, PartialEq)]
struct Group {
    /// Minutes before this one (0: this minute); `None` in a lane's row.
    ago: Option<i64>,
    provider: Option<String>,
    lane: Option<String>,
    /// Sent in the last 60 s.
    recent: bool,
    sent: i64,
    /// Lateness (sent minus due) summed over the rows that have a due time, seconds.
    late_sum: f64,
    late_count: i64,
    /// A lane's row of the last 60 s: its lateness percentiles.
    p50: Option<f64>,
    p99: Option<f64>,
}

/// What was sent in the last hour ([`Inbox::recent_sends`]), for each reader's view.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct RecentSends {
    /// By minute, transport and lane.
    groups: Vec<Group>,
    /// By lane, in the last 60 s and before.
    lanes: Vec<Group>,
}

/// One transport's recent sends ([`RecentSends::by_provider`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ProviderSends {
    /// The transport's name, `None` for rows sent before postie recorded it.
    pub(crate) provider: Option<String>,
    /// Sent in the last 60 s.
    pub(crate) last_minute: i64,
    /// Sent in the last hour.
    pub(crate) last_hour: i64,
}

/// One lane's sends over the last 60 s ([`RecentSends::by_lane`]).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LaneSends {
    /// The lane (`None`: the default lane, or rows recorded before lanes).
    pub(crate) lane: Option<String>,
    /// Emails sent in the last 60 s.
    pub(crate) sent: i64,
    /// Their lateness (sent minus due), median and 99th percentile, in seconds.
    pub(crate) lateness_p50: f64,
    /// See `lateness_p50`.
    pub(crate) lateness_p99: f64,
}

/// Sends of one minute of the last hour ([`RecentSends::per_minute`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct MinuteSends {
    /// Minutes before now (0: this minute).
    pub(crate) ago: i64,
    /// Emails sent in that minute.
    pub(crate) sent: i64,
    /// Mean lateness of those with a due time: sent minus due, seconds.
    pub(crate) lateness_s: Option<f64>,
}

impl RecentSends {
    /// Emails sent in the last 60 s, fleet-wide.
    pub(crate) fn last_minute(&self) -> i64 {
        self.groups
            .iter()
            .filter(|g| g.recent)
            .map(|g| g.sent)
            .sum()
    }

    /// Each transport's sends in the last 60 s and the last hour, by name.
    pub(crate) fn by_provider(&self) -> Vec<ProviderSends> {
        let mut by: std::collections::BTreeMap<Option<&str>, (i64, i64)> = Default::default();
        for g in &self.groups {
            let entry = by.entry(g.provider.as_deref()).or_default();
            entry.0 += if g.recent { g.sent } else { 0 };
            entry.1 += g.sent;
        }
        by.into_iter()
            .map(|(provider, (last_minute, last_hour))| ProviderSends {
                provider: provider.map(str::to_owned),
                last_minute,
                last_hour,
            })
            .collect()
    }

    /// Each lane's sends and lateness over the last 60 s, busiest first.
    pub(crate) fn by_lane(&self) -> Vec<LaneSends> {
        let mut lanes: Vec<LaneSends> = self
            .lanes
            .iter()
            .filter(|g| g.recent)
            .map(|g| LaneSends {
                lane: g.lane.clone(),
                sent: g.sent,
                lateness_p50: g.p50.unwrap_or(0.0),
                lateness_p99: g.p99.unwrap_or(0.0),
            })
            .collect();
        lanes.sort_by(|a, b| b.sent.cmp(&a.sent).then_with(|| a.lane.cmp(&b.lane)));
        lanes
    }

    /// The minutes of the last hour that had sends (this one and the 59 before),
    /// oldest first, each with its mean lateness.
    pub(crate) fn per_minute(&self) -> Vec<MinuteSends> {
        let mut by: std::collections::BTreeMap<i64, (i64, f64, i64)> = Default::default();
        for g in &self.groups {
            let Some(ago) = g.ago.filter(|ago| (0..60).contains(ago)) else {
                continue;
            };
            let entry = by.entry(ago).or_default();
            entry.0 += g.sent;
            entry.1 += g.late_sum;
            entry.2 += g.late_count;
        }
        by.into_iter()
            .rev()
            .map(|(ago, (sent, late_sum, late_count))| MinuteSends {
                ago,
                sent,
                lateness_s: (late_count > 0).then(|| late_sum / late_count as f64),
            })
            .collect()
    }
}

impl Inbox {
    /// What was sent in the last hour, fleet-wide, in one statement: the one count
    /// `postie status` and the console read.
    pub(crate) async fn recent_sends(&self) -> Result<RecentSends, DbError> {
        let client = self.pool.get().await?;
        let stmt = client.prepare_cached(RECENT_SENDS).await?;
        let mut sends = RecentSends::default();
        for row in client.query(&stmt, &[]).await? {
            let group = Group {
                ago: row.try_get(1)?,
                provider: row.try_get(2)?,
                lane: row.try_get(3)?,
                recent: row.try_get(4)?,
                sent: row.try_get(5)?,
                late_sum: row.try_get(6)?,
                late_count: row.try_get(7)?,
                p50: row.try_get(8)?,
                p99: row.try_get(9)?,
            };
            if row.try_get(0)? {
                sends.lanes.push(group);
            } else {
                sends.groups.push(group);
            }
        }
        Ok(sends)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(ago: i64, provider: &str, lane: Option<&str>, recent: bool, sent: i64) -> Group {
        Group {
            ago: Some(ago),
            provider: Some(provider.into()),
            lane: lane.map(Into::into),
            recent,
            sent,
            late_sum: sent as f64 * 0.5,
            late_count: sent,
            p50: None,
            p99: None,
        }
    }

    #[test]
    fn each_reader_sees_its_view_of_the_one_count() {
        let lane = |lane: Option<&str>, recent: bool, sent: i64, p50: f64, p99: f64| Group {
            ago: None,
            provider: None,
            lane: lane.map(Into::into),
            recent,
            sent,
            late_sum: 0.0,
            late_count: 0,
            p50: recent.then_some(p50),
            p99: recent.then_some(p99),
        };
        let sends = RecentSends {
            groups: vec![
                // This minute and the one before, both within the last 60 s.
                group(0, "ses", None, true, 5),
                group(1, "ses", Some("bulk"), true, 3),
                group(1, "ses", Some("bulk"), false, 7),
                group(30, "smtp", None, false, 10),
                // Sent 60 minutes ago by the clock's minute: in the hour, not the chart.
                group(60, "smtp", None, false, 2),
            ],
            lanes: vec![
                lane(None, true, 5, 0.2, 0.9),
                lane(Some("bulk"), true, 3, 1.5, 4.0),
                lane(Some("bulk"), false, 7, 0.0, 0.0),
                lane(None, false, 12, 0.0, 0.0),
            ],
        };
        assert_eq!(sends.last_minute(), 8);
        assert_eq!(
            sends.by_provider(),
            vec![
                ProviderSends {
                    provider: Some("ses".into()),
                    last_minute: 8,
                    last_hour: 15
                },
                ProviderSends {
                    provider: Some("smtp".into()),
                    last_minute: 0,
                    last_hour: 12
                },
            ]
        );
        let lanes = sends.by_lane();
        assert_eq!(lanes.len(), 2, "{lanes:?}");
        assert_eq!((lanes[0].lane.as_deref(), lanes[0].sent), (None, 5));
        assert_eq!(
            (
                lanes[1].lane.as_deref(),
                lanes[1].sent,
                lanes[1].lateness_p99
            ),
            (Some("bulk"), 3, 4.0)
        );
        let minutes = sends.per_minute();
        assert_eq!(
            minutes.iter().map(|m| (m.ago, m.sent)).collect::<Vec<_>>(),
            vec![(30, 10), (1, 10), (0, 5)],
            "oldest first, minute 60 left out"
        );
        assert_eq!(minutes[1].lateness_s, Some(0.5));
        assert_eq!(RecentSends::default().per_minute(), vec![]);
        assert_eq!(RecentSends::default().last_minute(), 0);
    }
}
