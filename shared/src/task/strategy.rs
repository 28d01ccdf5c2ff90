//! How a task asks to be routed among the groups with room (the choice itself is
//! [`crate::route`]'s).

/// How to choose among the groups with room.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    /// Lowest `(running + reserved) / capacity`.
    #[default]
    LeastLoaded,
    /// Rotate over the matching groups (a counter per lane and candidate set).
    RoundRobin,
    /// Random, weighted by free capacity × health (error ratio and CPU from heartbeats), as in
    /// the SRE book's weighted round robin.
    Weighted,
}

impl Strategy {
    /// The strategy's word: `least_loaded`, `round_robin` or `weighted`.
    pub fn as_str(self) -> &'static str {
        match self {
            Strategy::LeastLoaded => "least_loaded",
            Strategy::RoundRobin => "round_robin",
            Strategy::Weighted => "weighted",
        }
    }

    /// The strategy [`as_str`](Self::as_str) names; `None` for any other word.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "least_loaded" => Some(Strategy::LeastLoaded),
            "round_robin" => Some(Strategy::RoundRobin),
            "weighted" => Some(Strategy::Weighted),
            _ => None,
        }
    }
}
