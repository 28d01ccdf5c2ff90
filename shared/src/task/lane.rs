//! The two lanes ([`Lane`]) and a value per lane ([`PerLane`]).

/// The two lanes. Each has its own ingress queue, group queues, consumers and capacity.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Default,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Lane {
    /// Ordinary work (the default).
    #[default]
    Normal,
    /// Work that must not wait behind the normal lane (its own capacity on every worker),
    /// and the scheduler's health probes.
    Critical,
}

impl Lane {
    /// Both lanes, normal first.
    pub const ALL: [Lane; 2] = [Lane::Normal, Lane::Critical];

    /// The lane's word on the wire and in names: `normal` or `critical`.
    pub fn as_str(self) -> &'static str {
        match self {
            Lane::Normal => "normal",
            Lane::Critical => "critical",
        }
    }

    /// The lane [`as_str`](Self::as_str) names; `None` for any other word (case matters).
    pub fn parse(s: &str) -> Option<Lane> {
        match s {
            "normal" => Some(Lane::Normal),
            "critical" => Some(Lane::Critical),
            _ => None,
        }
    }
}

impl std::fmt::Display for Lane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One value per lane (a capacity, a rate limit, a counter), where a pair of fields
/// `x`/`critical_x` would otherwise be carried. Indexable by [`Lane`]: `caps[lane]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PerLane<T> {
    /// The normal lane's value.
    pub normal: T,
    /// The critical lane's value.
    pub critical: T,
}

impl<T> PerLane<T> {
    /// The value of `lane`.
    pub fn get(&self, lane: Lane) -> &T {
        match lane {
            Lane::Normal => &self.normal,
            Lane::Critical => &self.critical,
        }
    }

    /// The value of `lane`, to change it.
    pub fn get_mut(&mut self, lane: Lane) -> &mut T {
        match lane {
            Lane::Normal => &mut self.normal,
            Lane::Critical => &mut self.critical,
        }
    }

    /// Each lane with its value, in [`Lane::ALL`] order.
    pub fn iter(&self) -> impl Iterator<Item = (Lane, &T)> {
        Lane::ALL.into_iter().map(move |l| (l, self.get(l)))
    }

    /// Each lane's value through `f`.
    pub fn map<U>(self, mut f: impl FnMut(T) -> U) -> PerLane<U> {
        PerLane {
            normal: f(self.normal),
            critical: f(self.critical),
        }
    }
}

impl<T> std::ops::Index<Lane> for PerLane<T> {
    type Output = T;
    fn index(&self, lane: Lane) -> &T {
        self.get(lane)
    }
}

impl<T> std::ops::IndexMut<Lane> for PerLane<T> {
    fn index_mut(&mut self, lane: Lane) -> &mut T {
        self.get_mut(lane)
    }
}
