//! One problem with one field of a spec: what parsing, validation, planning and the API
//! report, each error naming the field it is about (`parallel.tp`), so the browser's form
//! can show it beside that field.

use serde::{Deserialize, Serialize};

/// One problem with one field of a spec, e.g. `parallel.tp`: "tp=3 does not divide heads=4".
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FieldError {
    pub field: String,
    pub message: String,
}

impl FieldError {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self { field: field.into(), message: message.into() }
    }
}

impl std::fmt::Display for FieldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.field.is_empty() {
            write!(f, "{}", self.message)
        } else {
            write!(f, "{}: {}", self.field, self.message)
        }
    }
}
