"""The JSON-schema suite for structured outputs (OpenAI `response_format: json_schema`).

Data, no tests: tests/test_structured_schemas.py random-walks every schema through
llguidance (proving the library compiles and enforces it end to end), the engine and server tests
decode the real default model (SmolLM2-135M-Instruct) under each and check the text with
`validate` (tests/schema_validation.py).

Every case is *bounded* unless marked `bounded=False`: each free string has a `maxLength` (<= 40),
each array a `maxItems` (<= 5), and each object `additionalProperties: false`, so that a 135M
model finishes inside ~200 tokens. Two cases deliberately leave strings (and, in one, an array)
unbounded, for tests that want to see max_tokens end a constrained generation.

Coverage: flat and nested objects (four levels deep), arrays with minItems/maxItems (of strings,
objects, arrays, a top-level array, a prefixItems tuple), enums (strings, integers, mixed with
null), `const`, `anyOf`, `oneOf` (with disjoint branches: llguidance refuses overlapping ones),
integer and number bounds (minimum, maximum, exclusiveMinimum, exclusiveMaximum, multipleOf),
string formats (date, time, date-time, email, uuid, ipv4, ipv6), `pattern`, minLength/maxLength,
required vs optional properties, `additionalProperties: false`, `$defs` with `$ref`, booleans,
nulls and nullable types, type unions, annotations (title, description), and OpenAI-style tool
call arguments (get_weather).

Keywords llguidance 1.9.1 does not implement, and so left out of the suite (it warns "Unimplemented
keys" or refuses): `propertyNames`, `contains`, `dependentRequired`, `uniqueItems`, overlapping
`oneOf` branches (it asks for the `coerce_one_of` option), and `minProperties`/`maxProperties`
unless every listed property is required. Formats `hostname`, `duration` and `uri` compile, but
jsonschema cannot check them here (its checkers need fqdn, isoduration, rfc3987), so they are left
out too; see tests/schema_validation.py's `FORMAT_CHECKER` for date-time and time.
"""

from schema_validation import SchemaCase, bounded_str
from structured_schemas_structure import STRUCTURE_SCHEMAS

SCHEMAS: list[SchemaCase] = [
    SchemaCase(
        "book",
        {
            "type": "object",
            "properties": {
                "title": bounded_str(40),
                "author": bounded_str(40),
                "year": {"type": "integer", "minimum": 1450, "maximum": 2025},
            },
            "required": ["title", "author", "year"],
            "additionalProperties": False,
        },
        "Give a JSON object describing a book: title, author, year.",
        example={"title": "Dune", "author": "Frank Herbert", "year": 1965},
    ),
    SchemaCase(
        "person_with_address",  # a nested object
        {
            "type": "object",
            "properties": {
                "name": bounded_str(30),
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "address": {
                    "type": "object",
                    "properties": {
                        "street": bounded_str(40),
                        "city": bounded_str(30),
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    },
                    "required": ["street", "city", "zip"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "age", "address"],
            "additionalProperties": False,
        },
        "Give a JSON object describing a person: name, age, and an address with street, city and a 5-digit zip.",
        example={
            "name": "Ana Silva",
            "age": 34,
            "address": {"street": "12 Rua Augusta", "city": "Lisbon", "zip": "11000"},
        },
    ),
    SchemaCase(
        "shopping_list",  # an array of strings with minItems/maxItems
        {
            "type": "object",
            "properties": {
                "store": bounded_str(30),
                "items": {"type": "array", "items": bounded_str(20), "minItems": 2, "maxItems": 5},
            },
            "required": ["store", "items"],
            "additionalProperties": False,
        },
        "Give a JSON shopping list: the store and two to five items to buy.",
        example={"store": "Corner Market", "items": ["milk", "eggs", "bread"]},
    ),
    SchemaCase(
        "weekday_enum",
        {
            "type": "object",
            "properties": {
                "day": {"enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]},
                "mood": {"type": "string", "enum": ["happy", "sad", "tired", "excited"]},
            },
            "required": ["day", "mood"],
            "additionalProperties": False,
        },
        "Give a JSON object with your favourite day of the week and your mood on that day.",
        example={"day": "Saturday", "mood": "happy"},
    ),
    SchemaCase(
        "event_const",  # `const` fixes the values
        {
            "type": "object",
            "properties": {
                "version": {"const": 2},
                "kind": {"const": "login"},
                "user": bounded_str(24),
                "success": {"type": "boolean"},
            },
            "required": ["version", "kind", "user", "success"],
            "additionalProperties": False,
        },
        "Give a JSON log event (version 2, kind login) for a user named alice who logged in successfully.",
        example={"version": 2, "kind": "login", "user": "alice", "success": True},
    ),
    SchemaCase(
        "contact_anyof",
        {
            "type": "object",
            "properties": {
                "name": bounded_str(30),
                "contact": {
                    "anyOf": [
                        {
                            "type": "object",
                            "properties": {"email": {"type": "string", "format": "email", "maxLength": 40}},
                            "required": ["email"],
                            "additionalProperties": False,
                        },
                        {
                            "type": "object",
                            "properties": {"phone": {"type": "string", "pattern": "^\\+?[0-9]{7,12}$"}},
                            "required": ["phone"],
                            "additionalProperties": False,
                        },
                    ]
                },
            },
            "required": ["name", "contact"],
            "additionalProperties": False,
        },
        "Give a JSON contact card: a name and either an email address or a phone number.",
        example={"name": "Bob Stone", "contact": {"email": "bob@example.com"}},
    ),
    SchemaCase(
        "shape_oneof",  # branches told apart by a `const` discriminator, so exactly one matches
        {
            "oneOf": [
                {
                    "type": "object",
                    "properties": {
                        "shape": {"const": "circle"},
                        "radius": {"type": "number", "exclusiveMinimum": 0, "maximum": 100},
                    },
                    "required": ["shape", "radius"],
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "properties": {
                        "shape": {"const": "rectangle"},
                        "width": {"type": "number", "exclusiveMinimum": 0, "maximum": 100},
                        "height": {"type": "number", "exclusiveMinimum": 0, "maximum": 100},
                    },
                    "required": ["shape", "width", "height"],
                    "additionalProperties": False,
                },
            ]
        },
        "Describe a shape as JSON: either a circle with a radius or a rectangle with a width and height.",
        example={"shape": "rectangle", "width": 4.5, "height": 2},
    ),
    SchemaCase(
        "thermostat_numbers",  # integer and number bounds
        {
            "type": "object",
            "properties": {
                "target_celsius": {"type": "number", "minimum": 5, "maximum": 30},
                "humidity_percent": {"type": "integer", "minimum": 0, "maximum": 100},
                "fan_speed": {"type": "integer", "minimum": 0, "maximum": 100, "multipleOf": 10},
                "power_watts": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 5000},
            },
            "required": ["target_celsius", "humidity_percent", "fan_speed", "power_watts"],
            "additionalProperties": False,
        },
        "Give a JSON thermostat setting: target temperature in Celsius, humidity percent, fan speed, power in watts.",
        example={"target_celsius": 21.5, "humidity_percent": 45, "fan_speed": 30, "power_watts": 1200},
    ),
    SchemaCase(
        "meeting_datetime",  # date, time, date-time formats
        {
            "type": "object",
            "properties": {
                "title": bounded_str(40),
                "date": {"type": "string", "format": "date"},
                # time and date-time allow fractional seconds of any length: a small model can
                # write digits forever there, so the lengths are bounded (llguidance intersects them)
                "start_time": {"type": "string", "format": "time", "maxLength": 20},
                "created_at": {"type": "string", "format": "date-time", "maxLength": 32},
            },
            "required": ["title", "date", "start_time", "created_at"],
            "additionalProperties": False,
        },
        "Give a JSON object for a team meeting: title, date, start time, and when the invite was created.",
        example={
            "title": "Weekly sync",
            "date": "2025-03-14",
            "start_time": "10:30:00Z",
            "created_at": "2025-03-10T08:15:00+01:00",
        },
    ),
    SchemaCase(
        "user_account",  # uuid and email formats, a pattern with lengths
        {
            "type": "object",
            "properties": {
                "id": {"type": "string", "format": "uuid"},
                "email": {"type": "string", "format": "email", "maxLength": 40},
                "username": {"type": "string", "minLength": 3, "maxLength": 16, "pattern": "^[a-z0-9_]+$"},
            },
            "required": ["id", "email", "username"],
            "additionalProperties": False,
        },
        "Give a JSON user account with a UUID id, an email address and a lowercase username.",
        example={"id": "3f2b8c1e-9d4a-4e7b-a1c2-5d6e7f8a9b0c", "email": "jo@example.org", "username": "jo_smith"},
    ),
    SchemaCase(
        "server_addresses",  # ipv4 and ipv6 formats
        {
            "type": "object",
            "properties": {
                "name": bounded_str(24),
                "ipv4": {"type": "string", "format": "ipv4"},
                "ipv6": {"type": "string", "format": "ipv6"},
                "port": {"type": "integer", "minimum": 1, "maximum": 65535},
            },
            "required": ["name", "ipv4", "ipv6", "port"],
            "additionalProperties": False,
        },
        "Give a JSON object for a web server: its name, IPv4 address, IPv6 address and port.",
        example={"name": "web-1", "ipv4": "192.168.1.10", "ipv6": "2001:db8::1", "port": 8080},
    ),
    SchemaCase(
        "product_pattern",
        {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "color_hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"},
                "name": bounded_str(30),
            },
            "required": ["sku", "color_hex", "name"],
            "additionalProperties": False,
        },
        "Give a JSON product: an SKU like ABC-1234, its color as a hex code like #ff0000, and its name.",
        example={"sku": "ABC-1234", "color_hex": "#ff0000", "name": "Red mug"},
    ),
    SchemaCase(
        "string_lengths",  # minLength/maxLength
        {
            "type": "object",
            "properties": {
                "nickname": {"type": "string", "minLength": 2, "maxLength": 12},
                "pin": {"type": "string", "minLength": 4, "maxLength": 6, "pattern": "^[0-9]+$"},
                "motto": {"type": "string", "minLength": 10, "maxLength": 40},
            },
            "required": ["nickname", "pin", "motto"],
            "additionalProperties": False,
        },
        "Give a JSON profile with a short nickname, a 4 to 6 digit PIN and a motto.",
        example={"nickname": "Kiki", "pin": "4821", "motto": "Carpe diem, always."},
    ),
    SchemaCase(
        "optional_profile",  # only "name" is required
        {
            "type": "object",
            "properties": {
                "name": bounded_str(30),
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "city": bounded_str(30),
                "nickname": bounded_str(20),
            },
            "required": ["name"],
            "additionalProperties": False,
        },
        "Give a JSON profile of a person. The name is required; age, city and nickname are optional.",
        example={"name": "Lee", "city": "Seoul"},
    ),
    SchemaCase(
        "app_config",  # booleans, enums and bounded integers, all optional but one
        {
            "type": "object",
            "properties": {
                "debug": {"type": "boolean"},
                "log_level": {"enum": ["debug", "info", "warning", "error"]},
                "workers": {"type": "integer", "minimum": 1, "maximum": 16},
                "theme": {"enum": ["light", "dark"]},
            },
            "required": ["debug"],
            "additionalProperties": False,
        },
        "Give a JSON configuration for a web app: debug on or off, log level, number of workers, theme.",
        example={"debug": False, "log_level": "info", "workers": 4},
    ),
] + STRUCTURE_SCHEMAS

assert len({case.name for case in SCHEMAS}) == len(SCHEMAS), "case names must be unique"
