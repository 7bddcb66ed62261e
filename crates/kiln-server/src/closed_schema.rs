//! Strict JSON schemas: an object schema that lists `properties` and says nothing of
//! `additionalProperties` admits no other keys, as OpenAI's `strict: true` and vLLM's default
//! grammar backend read it (JSON Schema itself would admit any). A schema that states
//! `additionalProperties` (or `patternProperties`, `unevaluatedProperties`) keeps its word.
//!
//! Only schema positions are walked (`properties` values, `items`, `anyOf`, `$defs`, ...), so
//! a property named like a keyword is never taken for one.

use serde_json::Value;

/// Keywords whose value is one schema.
const ONE: &[&str] = &[
    "items",
    "additionalItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "additionalProperties",
    "propertyNames",
];
/// Keywords whose value is a list of schemas.
const LIST: &[&str] = &["anyOf", "oneOf", "allOf", "prefixItems"];
/// Keywords whose value maps names to schemas.
const MAP: &[&str] = &["properties", "patternProperties", "$defs", "definitions"];

/// `schema` with `"additionalProperties": false` on every object schema that lists
/// `properties` and leaves the rest unsaid, except where `allOf` composes one object out of
/// several schemas (the object itself and its members stay open: each member describes only
/// part of the keys, and closing them would make the whole unsatisfiable).
pub fn close(schema: &mut Value) {
    close_node(schema, true);
}

fn close_node(schema: &mut Value, close_self: bool) {
    let Value::Object(node) = schema else { return };
    let open_ended = ["additionalProperties", "patternProperties", "unevaluatedProperties"];
    if close_self
        && node.get("properties").is_some_and(Value::is_object)
        && !node.contains_key("allOf")
        && !open_ended.iter().any(|k| node.contains_key(*k))
    {
        node.insert("additionalProperties".into(), Value::Bool(false));
    }
    for (key, value) in node.iter_mut() {
        let key = key.as_str();
        if ONE.contains(&key) {
            close(value);
        } else if key == "allOf" {
            value.as_array_mut().into_iter().flatten().for_each(|m| close_node(m, false));
        } else if LIST.contains(&key) {
            value.as_array_mut().into_iter().flatten().for_each(close);
        } else if MAP.contains(&key) {
            value.as_object_mut().into_iter().flat_map(|m| m.values_mut()).for_each(close);
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn objects_composed_by_all_of_stay_open() {
        let member = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let mut schema = json!({"allOf": [member, {"properties": {"b": {}}}],
                                "properties": {"c": {"properties": {"d": {}}}}});
        close(&mut schema);
        assert_eq!(schema["allOf"][0], member);
        assert!(schema.get("additionalProperties").is_none());
        assert_eq!(schema["properties"]["c"]["additionalProperties"], json!(false));
    }

    #[test]
    fn objects_with_properties_are_closed_where_the_schema_is_silent() {
        let mut schema = json!({
            "type": "object",
            "properties": {
                "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
                "properties": {"type": "string"},
                "open": {"type": "object", "properties": {}, "additionalProperties": true},
                "list": {"type": "array", "items": {"properties": {"y": {}}}},
            },
            "$defs": {"d": {"anyOf": [{"properties": {"z": {}}}, {"type": "null"}]}},
        });
        close(&mut schema);
        assert_eq!(schema["additionalProperties"], false);
        assert_eq!(schema["properties"]["a"]["additionalProperties"], false);
        // A property named `properties` is a property, not a keyword.
        assert_eq!(schema["properties"]["properties"], json!({"type": "string"}));
        assert_eq!(schema["properties"]["open"]["additionalProperties"], true);
        assert_eq!(schema["properties"]["list"]["items"]["additionalProperties"], false);
        assert_eq!(schema["$defs"]["d"]["anyOf"][0]["additionalProperties"], false);
        assert_eq!(schema["$defs"]["d"]["anyOf"][1], json!({"type": "null"}));
        let mut free = json!({"type": "object"});
        close(&mut free);
        assert_eq!(free, json!({"type": "object"}));
    }
}
